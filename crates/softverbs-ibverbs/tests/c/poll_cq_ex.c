/* Built by tests/capi.rs against Debian's <infiniband/verbs.h> and softverbs' own
 * <softverbs/verbs_ext.h>, linked to the softverbs drop-in (ibv_poll_cq_ex and
 * ibv_wc_ex_cq_flags are exported by it only) and run with it. Prints "ok" and exits 0.
 *
 * - The seed's layout helpers against an independent computation, for every combination of
 *   field flags, plus a few values worked out by hand.
 * - For CQs made with ibv_create_cq_ex with several wc_flags sets (and one with ibv_create_cq):
 *   RC SEND, SEND_WITH_IMM, RDMA_WRITE_WITH_IMM and RDMA_READ between two QPs, polled with
 *   ibv_poll_cq_ex; every header field and every requested field is checked against what was
 *   sent; timestamps are nonzero and nondecreasing, the wall clock lies between
 *   CLOCK_REALTIME readings taken before posting and after polling.
 * - Errors: comp_mask != 0, NULL attr / CQ / buffer, a CQ not from the library and a destroyed
 *   one give -EINVAL; ibv_wc_ex_cq_flags of those gives 0 with errno EINVAL. */
#include <arpa/inet.h>
#include <softverbs/verbs_ext.h>

#include "common.h"

#define F(x) IBV_WC_EX_SEED_WITH_##x
#define RECV_ONLY (F(IMM) | F(SRC_QP) | F(PKEY_INDEX) | F(SLID) | F(SL) | F(DLID_PATH_BITS))

/* The fields in the seed's order (largest first, flag order within a size), with sizes. */
static const struct {
    uint64_t flag;
    size_t size;
} FIELDS[] = {
    {F(COMPLETION_TIMESTAMP), 8}, {F(COMPLETION_TIMESTAMP_WALLCLOCK), 8},
    {F(BYTE_LEN), 4}, {F(IMM), 4}, {F(QP_NUM), 4}, {F(SRC_QP), 4},
    {F(PKEY_INDEX), 2}, {F(SLID), 2},
    {F(SL), 1}, {F(DLID_PATH_BITS), 1},
};
#define NFIELDS (sizeof FIELDS / sizeof FIELDS[0])

/* Offset from buffer[] of `flag` under CQ flags `cq`, by walking the record. */
static size_t walk_offset(uint64_t cq, uint64_t flag) {
    size_t off = 0;
    for (size_t i = 0; i < NFIELDS && FIELDS[i].flag != flag; i++)
        if (cq & FIELDS[i].flag) off += FIELDS[i].size;
    return off;
}

static size_t seed_offset(uint64_t cq, uint64_t flag, size_t size) {
    enum ibv_wc_flags_ex f = (enum ibv_wc_flags_ex)flag;
    switch (size) {
    case 8: return ibv_wc_ex_get_offsetof64(cq, f);
    case 4: return ibv_wc_ex_get_offsetof32(cq, f);
    case 2: return ibv_wc_ex_get_offsetof16(cq, f);
    default: return ibv_wc_ex_get_offsetof8(cq, f);
    }
}

static void layout_formulas(void) {
    CHECK(sizeof(struct ibv_wc_ex) == 32 && offsetof(struct ibv_wc_ex, buffer) == 32);
    CHECK(offsetof(struct ibv_wc_ex, status) == 16 && offsetof(struct ibv_wc_ex, opcode) == 20);
    CHECK(offsetof(struct ibv_wc_ex, vendor_err) == 24);
    CHECK(sizeof(struct ibv_poll_cq_ex_attr) == 8);
    /* Every combination of the ten field flags (bits 4..13), with output bits mixed in. */
    for (uint64_t m = 0; m < (1u << NFIELDS); m++) {
        uint64_t cq = 0, total = 0;
        for (size_t i = 0; i < NFIELDS; i++)
            if (m & (1u << i)) {
                cq |= FIELDS[i].flag;
                total += FIELDS[i].size;
            }
        for (size_t i = 0; i < NFIELDS; i++)
            if (cq & FIELDS[i].flag) {
                size_t off = walk_offset(cq, FIELDS[i].flag);
                CHECK(seed_offset(cq, FIELDS[i].flag, FIELDS[i].size) == off);
                CHECK(seed_offset(cq | 0xf, FIELDS[i].flag, FIELDS[i].size) == off);
                CHECK(off % FIELDS[i].size == 0); /* naturally aligned */
            }
        CHECK(ibv_wc_ex_get_size(cq) == 32 + ((total + 7) & ~(uint64_t)7));
        CHECK(ibv_wc_ex_get_size(cq | 0xf) == ibv_wc_ex_get_size(cq));
    }
    /* By hand. */
    CHECK(ibv_wc_ex_get_size(0) == 32);
    CHECK(ibv_wc_ex_get_size(F(BYTE_LEN)) == 40);
    CHECK(ibv_wc_ex_get_size(F(BYTE_LEN) | F(COMPLETION_TIMESTAMP)) == 48);
    CHECK(ibv_wc_ex_get_size(IBV_WC_EX_SEED_STANDARD_FLAGS) == 32 + 24); /* 16 + 4 + 2 → 24 */
    uint64_t f = F(COMPLETION_TIMESTAMP) | F(COMPLETION_TIMESTAMP_WALLCLOCK) | F(BYTE_LEN) |
                 F(QP_NUM) | F(SLID) | F(SL);
    CHECK(ibv_wc_ex_get_offsetof64(f, IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK) == 8);
    CHECK(ibv_wc_ex_get_offsetof32(f, IBV_WC_EX_SEED_WITH_QP_NUM) == 20);
    CHECK(ibv_wc_ex_get_offsetof16(f, IBV_WC_EX_SEED_WITH_SLID) == 24);
    CHECK(ibv_wc_ex_get_offsetof8(f, IBV_WC_EX_SEED_WITH_SL) == 26);
    CHECK(ibv_wc_ex_get_size(f) == 64);
    /* The getters read where the offsets say. */
    uint64_t rec[8] = {0};
    struct ibv_wc_ex *w = (struct ibv_wc_ex *)rec;
    uint64_t ts = 0x0123456789abcdefull;
    uint32_t qpn = 0xfeedbeef;
    uint16_t slid = 0x4321;
    memcpy(w->buffer, &ts, 8);
    memcpy(w->buffer + 20, &qpn, 4);
    memcpy(w->buffer + 24, &slid, 2);
    w->buffer[26] = 9;
    CHECK(ibv_wc_ex_get64(w, f, IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP) == ts);
    CHECK(ibv_wc_ex_get32(w, f, IBV_WC_EX_SEED_WITH_QP_NUM) == qpn);
    CHECK(ibv_wc_ex_get16(w, f, IBV_WC_EX_SEED_WITH_SLID) == slid);
    CHECK(ibv_wc_ex_get8(w, f, IBV_WC_EX_SEED_WITH_SL) == 9);
    /* Shipped creation flags → seed flags. */
    CHECK(ibv_wc_ex_seed_flags(IBV_WC_STANDARD_FLAGS) ==
          (IBV_WC_EX_SEED_STANDARD_FLAGS & ~(uint64_t)F(PKEY_INDEX)));
    CHECK(ibv_wc_ex_seed_flags(IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK) ==
          F(COMPLETION_TIMESTAMP_WALLCLOCK));
}

struct env {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_mr *ma, *mb;
    union ibv_gid gid;
    uint16_t lid;
    uint64_t ts_mask;
};

/* What each work request must complete as. */
struct expect {
    uint64_t wr_id;
    enum ibv_wc_opcode opcode;
    int recv;
    uint32_t byte_len; /* checked on receives and the READ */
    int imm;
    uint32_t imm_host;
    int seen;
};

#define MAX_REC 80 /* bytes: the largest record is 32 + 16 + 16 + 4 + 2 → 72 */
#define BATCH 3

/* Traffic over a CQ (made by ibv_create_cq_ex with `wc_flags`, or by ibv_create_cq when
 * `plain`), polled with ibv_poll_cq_ex in batches of up to BATCH records. */
static void traffic(struct env *e, uint64_t wc_flags, int plain) {
    struct ibv_cq *cq;
    if (plain) {
        cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0);
        CHECK(cq);
        wc_flags = IBV_WC_STANDARD_FLAGS;
    } else {
        struct ibv_cq_init_attr_ex ca = {0};
        ca.cqe = 64;
        ca.wc_flags = wc_flags;
        struct ibv_cq_ex *cx = ibv_create_cq_ex(e->ctx, &ca);
        CHECK(cx);
        cq = ibv_cq_ex_to_cq(cx);
    }
    uint64_t flags = ibv_wc_ex_cq_flags(cq);
    CHECK(flags == ibv_wc_ex_seed_flags(wc_flags));
    size_t sz = ibv_wc_ex_get_size(flags);
    CHECK(sz <= MAX_REC && sz % 8 == 0);

    struct ibv_qp *qa, *qb;
    create_rc_pair(e->pd, cq, &qa, &qb);
    connect_rc_pair(qa, qb, &e->gid, RC_ACCESS_ALL);

    char *a = e->ma->addr, *b = e->mb->addr;
    memset(a, 0, 1024);
    memset(b, 0, 1024);
    struct ibv_sge rsge = {(uintptr_t)b, 64, e->mb->lkey};
    struct ibv_recv_wr rwr = {.sg_list = &rsge, .num_sge = 1}, *rbad;
    for (uint64_t id = 100; id <= 102; id++) { /* each into its own 64 bytes of b */
        rwr.wr_id = id;
        rsge.addr = (uintptr_t)(b + (id - 100) * 64);
        CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0);
    }
    struct expect ex[] = {
        {1, IBV_WC_SEND, 0, 0, 0, 0, 0},
        {2, IBV_WC_SEND, 0, 0, 0, 0, 0},
        {3, IBV_WC_RDMA_WRITE, 0, 0, 0, 0, 0},
        {4, IBV_WC_RDMA_READ, 0, 8, 0, 0, 0},
        {100, IBV_WC_RECV, 1, 21, 0, 0, 0},
        {101, IBV_WC_RECV, 1, 9, 1, 0x1234, 0},
        {102, IBV_WC_RECV_RDMA_WITH_IMM, 1, 11, 1, 0xabcd, 0},
    };
    const int nex = sizeof ex / sizeof ex[0];

    uint64_t before = realtime_ns();
    /* SEND, SEND_WITH_IMM, RDMA_WRITE_WITH_IMM, RDMA_READ. */
    struct ibv_sge sge = {(uintptr_t)a, 21, e->ma->lkey};
    struct ibv_send_wr wr = {0};
    strcpy(a, "hello over softverbs");
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    post(qa, &wr);
    /* Each send reads `a` when posted, so the next one may overwrite it. */
    strcpy(a + 32, "with imm");
    sge.addr = (uintptr_t)(a + 32);
    sge.length = 9;
    wr.wr_id = 2;
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.imm_data = htonl(0x1234);
    wr.send_flags = 0;
    post(qa, &wr);
    strcpy(a + 64, "write imm!");
    sge.addr = (uintptr_t)(a + 64);
    sge.length = 11;
    wr.wr_id = 3;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(0xabcd);
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 192);
    wr.wr.rdma.rkey = e->mb->rkey;
    wr.send_flags = 0;
    post(qa, &wr);
    strcpy(b + 256, "read me");
    sge.addr = (uintptr_t)(a + 256);
    sge.length = 8;
    wr.wr_id = 4;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 256);
    wr.send_flags = 0;
    post(qa, &wr);

    /* Poll in small batches; the buffer is pre-filled to see nothing is written past the
     * records returned. */
    uint64_t buf[(BATCH + 1) * MAX_REC / 8];
    int got = 0;
    uint64_t prev_ts = 0, prev_wall = 0;
    struct ibv_poll_cq_ex_attr pa = {.max_entries = BATCH, .comp_mask = 0};
    for (long spins = 0; got < nex; spins++) {
        CHECK(spins < 100000000L);
        memset(buf, 0xa5, sizeof buf);
        int n = ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, &pa);
        CHECK(n >= 0 && n <= BATCH && got + n <= nex);
        for (size_t i = (size_t)n * sz; i < sizeof buf; i++)
            CHECK(((unsigned char *)buf)[i] == 0xa5);
        uint64_t after = realtime_ns();
        for (int i = 0; i < n; i++) {
            const struct ibv_wc_ex *w = (const struct ibv_wc_ex *)((char *)buf + i * sz);
            struct expect *x = NULL;
            for (int k = 0; k < nex; k++)
                if (ex[k].wr_id == w->wr_id) x = &ex[k];
            CHECK(x && !x->seen);
            x->seen = 1;
            CHECK(w->status == IBV_WC_SUCCESS && w->vendor_err == 0 && w->reserved == 0);
            CHECK(w->opcode == (uint32_t)x->opcode);
            /* Output flags: immediate data exactly where it was sent; no invalidation. */
            CHECK(!!(w->wc_flags & IBV_WC_EX_SEED_IMM) == x->imm);
            CHECK(!(w->wc_flags & IBV_WC_EX_SEED_INV));
            /* Valid fields: all of the CQ's on a receive, the non-receive-only on a send. */
            uint64_t valid = w->wc_flags & ~(uint64_t)0xf;
            CHECK(valid == (x->recv ? flags : flags & ~(uint64_t)RECV_ONLY));
            if ((flags & F(BYTE_LEN)) && (x->recv || x->opcode == IBV_WC_RDMA_READ))
                CHECK(ibv_wc_ex_get32(w, flags, IBV_WC_EX_SEED_WITH_BYTE_LEN) == x->byte_len);
            if ((flags & F(IMM)) && x->imm)
                CHECK(ntohl(ibv_wc_ex_get32(w, flags, IBV_WC_EX_SEED_WITH_IMM)) ==
                      x->imm_host);
            if (flags & F(QP_NUM))
                CHECK(ibv_wc_ex_get32(w, flags, IBV_WC_EX_SEED_WITH_QP_NUM) ==
                      (x->recv ? qb->qp_num : qa->qp_num));
            if ((flags & F(SRC_QP)) && x->recv)
                CHECK(ibv_wc_ex_get32(w, flags, IBV_WC_EX_SEED_WITH_SRC_QP) == qa->qp_num);
            if ((flags & F(SLID)) && x->recv)
                CHECK(ibv_wc_ex_get16(w, flags, IBV_WC_EX_SEED_WITH_SLID) == e->lid);
            if ((flags & F(SL)) && x->recv)
                CHECK(ibv_wc_ex_get8(w, flags, IBV_WC_EX_SEED_WITH_SL) == 0);
            if ((flags & F(DLID_PATH_BITS)) && x->recv)
                CHECK(ibv_wc_ex_get8(w, flags, IBV_WC_EX_SEED_WITH_DLID_PATH_BITS) == 0);
            if (flags & F(COMPLETION_TIMESTAMP)) {
                uint64_t ts = ibv_wc_ex_get64(w, flags, IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP);
                CHECK(ts != 0 && (ts & ~e->ts_mask) == 0);
                /* Nondecreasing along the CQ (modulo the mask), by less than a minute. */
                if (prev_ts)
                    CHECK(((ts - prev_ts) & e->ts_mask) < 60000000000ull);
                prev_ts = ts;
            }
            if (flags & F(COMPLETION_TIMESTAMP_WALLCLOCK)) {
                uint64_t wall =
                    ibv_wc_ex_get64(w, flags, IBV_WC_EX_SEED_WITH_COMPLETION_TIMESTAMP_WALLCLOCK);
                /* Between the readings around it, with 50 ms for the conversion. */
                CHECK(wall + 50000000ull >= before && wall <= after + 50000000ull);
                CHECK(wall + 50000000ull >= prev_wall);
                prev_wall = wall;
            }
            /* Padding after the fields is zero. */
            size_t used = 32;
            for (size_t k = 0; k < NFIELDS; k++)
                if (flags & FIELDS[k].flag) used += FIELDS[k].size;
            for (size_t k = used; k < sz; k++) CHECK(((const unsigned char *)w)[k] == 0);
        }
        got += n;
    }
    for (int k = 0; k < nex; k++) CHECK(ex[k].seen);
    /* Empty now: 0, and max_entries 0 needs no buffer. */
    CHECK(ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, &pa) == 0);
    struct ibv_poll_cq_ex_attr zero = {0};
    CHECK(ibv_poll_cq_ex(cq, NULL, &zero) == 0);
    CHECK(strcmp(b, "hello over softverbs") == 0 && strcmp(b + 64, "with imm") == 0);
    CHECK(strcmp(b + 192, "write imm!") == 0 && strcmp(a + 256, "read me") == 0);

    /* Bad arguments on a live CQ. */
    pa.comp_mask = 1;
    CHECK(ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, &pa) == -EINVAL);
    pa.comp_mask = 1u << 31;
    CHECK(ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, &pa) == -EINVAL);
    pa.comp_mask = 0;
    CHECK(ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, NULL) == -EINVAL);
    CHECK(ibv_poll_cq_ex(cq, NULL, &pa) == -EINVAL);

    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_destroy_cq(cq) == 0);
    /* Destroyed: not a CQ any more. */
    CHECK(ibv_poll_cq_ex(cq, (struct ibv_wc_ex *)buf, &pa) == -EINVAL);
    errno = 0;
    CHECK(ibv_wc_ex_cq_flags(cq) == 0 && errno == EINVAL);
    CHECK(ibv_destroy_cq(cq) == EINVAL);
}

int main(void) {
    layout_formulas();

    struct env e = {0};
    e.ctx = open_first_device();
    struct ibv_device_attr_ex dax;
    CHECK(ibv_query_device_ex(e.ctx, NULL, &dax) == 0 && dax.completion_timestamp_mask != 0);
    e.ts_mask = dax.completion_timestamp_mask;
    struct ibv_port_attr port;
    CHECK(ibv_query_port(e.ctx, 1, &port) == 0);
    e.lid = port.lid;
    CHECK(ibv_query_gid(e.ctx, 1, 0, &e.gid) == 0);
    e.pd = ibv_alloc_pd(e.ctx);
    CHECK(e.pd);
    size_t len = 4096;
    char *a = aligned_alloc(4096, len), *b = aligned_alloc(4096, len);
    CHECK(a && b);
    int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    e.ma = ibv_reg_mr(e.pd, a, len, acc);
    e.mb = ibv_reg_mr(e.pd, b, len, acc);
    CHECK(e.ma && e.mb);

    /* Creation: unknown comp_mask → EINVAL; fields the device cannot give → EOPNOTSUPP. */
    struct ibv_cq_init_attr_ex ca = {0};
    ca.cqe = 8;
    ca.comp_mask = 1u << 7;
    errno = 0;
    CHECK(ibv_create_cq_ex(e.ctx, &ca) == NULL && errno == EINVAL);
    ca.comp_mask = 0;
    ca.wc_flags = IBV_WC_EX_WITH_CVLAN;
    errno = 0;
    CHECK(ibv_create_cq_ex(e.ctx, &ca) == NULL && errno == EOPNOTSUPP);

    const uint64_t all = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
                         IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
    const uint64_t sets[] = {
        0,
        IBV_WC_EX_WITH_BYTE_LEN,
        IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP,
        all,
        /* One field of each size, and the wall clock alone among the 64-bit ones. */
        IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL |
            IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK,
        IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_DLID_PATH_BITS,
    };
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) traffic(&e, sets[i], 0);
    traffic(&e, 0, 1); /* ibv_create_cq: the standard fields */
    CHECK(ibv_wc_ex_seed_flags(all) ==
          ((IBV_WC_EX_SEED_STANDARD_FLAGS & ~(uint64_t)F(PKEY_INDEX)) |
           IBV_WC_EX_SEED_WITH_64BIT_FIELDS));

    /* NULL and foreign CQs. */
    struct ibv_poll_cq_ex_attr pa = {.max_entries = 1};
    uint64_t buf[MAX_REC / 8];
    CHECK(ibv_poll_cq_ex(NULL, (struct ibv_wc_ex *)buf, &pa) == -EINVAL);
    struct ibv_cq fake;
    memset(&fake, 0, sizeof fake);
    fake.context = e.ctx;
    CHECK(ibv_poll_cq_ex(&fake, (struct ibv_wc_ex *)buf, &pa) == -EINVAL);
    errno = 0;
    CHECK(ibv_wc_ex_cq_flags(NULL) == 0 && errno == EINVAL);
    errno = 0;
    CHECK(ibv_wc_ex_cq_flags(&fake) == 0 && errno == EINVAL);

    CHECK(ibv_dereg_mr(e.ma) == 0 && ibv_dereg_mr(e.mb) == 0);
    CHECK(ibv_dealloc_pd(e.pd) == 0);
    CHECK(ibv_close_device(e.ctx) == 0);
    free(a);
    free(b);
    printf("ok\n");
    return 0;
}
