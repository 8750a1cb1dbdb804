/* Built by tests/capi.rs against Debian's <infiniband/verbs.h> and softverbs' own
 * <softverbs/verbs_ext.h>, linked to the softverbs drop-in (ibv_mr_set_layout_sg,
 * ibv_mr_set_layout_interleaved, ibv_query_mr_layout_caps, ibv_reg_mr_pages and
 * ibv_reg_mr_bitmap are exported by it only) and run
 * with it. Prints "ok" and exits 0.
 *
 * Seed 002's non-contiguous memory regions over two connected RC QPs of one process:
 * - ibv_query_mr_layout_caps and the struct layouts; bad pointers give EINVAL.
 * - The man page's interleaved example: odd and even items swapped through an interleaved
 *   layout over one region (the man page's struct names), sent with one SGE and received
 *   contiguous; the reverse, an RDMA WRITE of contiguous items into the layout by rkey.
 * - The man page's SG example: one SEND from two buffers of two MRs through an SG layout;
 *   plain buffers registered inside the call (IBV_MR_SET_LAYOUT_REGISTER_BUFFERS); an SG
 *   layout of an interleaved one (nesting).
 * - IBV_MR_SET_LAYOUT_WITH_POST_WR: the layout changes at the bind work request
 *   (ibv_wr_bind_mr), which completes with IBV_WC_BIND_MW; later sends see it.
 * - Every result: IBV_MR_SET_LAYOUT_ERR_INPUT (EINVAL; the old layout still works),
 *   _WOULD_INVALIDATE (EBUSY, with AVOID_INVALIDATION; key and layout unchanged),
 *   _UNSUPPORTED (EOPNOTSUPP: too many dimensions, SGEs or entries, nesting too deep, unknown
 *   flags); a key change without the flag, visible in mr->lkey/rkey, the old key dead.
 * - ibv_dereg_mr of a region a layout uses: EBUSY, and it keeps working; in inverse order it
 *   succeeds; NULL, foreign and already deregistered MRs give EINVAL.
 * - ibv_reg_mr_pages / ibv_reg_mr_bitmap: out-of-order pages and a sparse selection sent from
 *   and written into; bad arguments give EINVAL. */
#include <softverbs/verbs_ext.h>
#include <stddef.h>

#include "common.h"

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cqa, *cqb;
static struct ibv_qp *qa, *qb;
static struct ibv_mr *rmr; /* contiguous receive buffer */
static char *rbuf;
#define RBUF 8192

static void setup(void) {
    ctx = open_first_device();
    pd = ibv_alloc_pd(ctx);
    CHECK(pd);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    cqa = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    cqb = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(cqa && cqb);
    struct ibv_qp_init_attr ia = {0};
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 32;
    ia.cap.max_recv_wr = 32;
    ia.cap.max_send_sge = 2;
    ia.cap.max_recv_sge = 1;
    ia.send_cq = ia.recv_cq = cqa;
    qa = ibv_create_qp(pd, &ia);
    ia.send_cq = ia.recv_cq = cqb;
    qb = ibv_create_qp(pd, &ia);
    CHECK(qa && qb);
    connect_rc_pair(qa, qb, &gid,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    rbuf = aligned_alloc(64, RBUF);
    CHECK(rbuf);
    rmr = ibv_reg_mr(pd, rbuf, RBUF, IBV_ACCESS_LOCAL_WRITE);
    CHECK(rmr);
}

static void post_recv(void) {
    memset(rbuf, 0, RBUF);
    struct ibv_sge s = {(uintptr_t)rbuf, RBUF, rmr->lkey};
    struct ibv_recv_wr w = {.wr_id = 7, .sg_list = &s, .num_sge = 1}, *bad;
    CHECK(ibv_post_recv(qb, &w, &bad) == 0);
}

/* A signaled SEND `wr_id` from qa of `len` bytes at `addr` of key `lkey`. */
static void post_send1(uint64_t wr_id, uint32_t lkey, uint64_t addr, uint32_t len) {
    struct ibv_sge s = {addr, len, lkey};
    struct ibv_send_wr w = {0}, *bad = NULL;
    w.wr_id = wr_id;
    w.opcode = IBV_WR_SEND;
    w.sg_list = &s;
    w.num_sge = 1;
    w.send_flags = IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(qa, &w, &bad) == 0);
}

/* qa's SEND `wr_id` completes, and qb's receive (posted by post_recv) with `len` bytes. */
static void expect_sent(uint64_t wr_id, uint32_t len) {
    struct ibv_wc wc = poll1(cqa);
    if (wc.status != IBV_WC_SUCCESS)
        fprintf(stderr, "send: %s\n", ibv_wc_status_str(wc.status));
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.wr_id == wr_id);
    wc = poll1(cqb);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id == 7);
    CHECK(wc.byte_len == len);
}

/* SEND of `len` bytes at `addr` of key `lkey` from qa; qb receives exactly `want`. */
static void send_expect(uint32_t lkey, uint64_t addr, uint32_t len, const void *want) {
    post_recv();
    post_send1(1, lkey, addr, len);
    expect_sent(1, len);
    CHECK(memcmp(rbuf, want, len) == 0);
}

static void caps_query(struct ibv_mr_layout_caps *caps) {
    CHECK(sizeof(struct ibv_mr_layout_caps) == 32);
    CHECK(offsetof(struct ibv_mr_layout_caps, max_mr_nesting_level) == 28);
    CHECK(sizeof(struct ibv_mr_layout_interleaved) == 32);
    CHECK(offsetof(struct ibv_mr_layout_interleaved, num_repeated) == 16);
    CHECK(offsetof(struct ibv_mr_layout_interleaved, num_dimensions) == 20);
    CHECK(offsetof(struct ibv_mr_layout_interleaved, num_dimentsions) == 20);
    CHECK(offsetof(struct ibv_mr_layout_interleaved, dims) == 24);
    CHECK(sizeof(struct ibv_mr_layout_interleved_dimensions) == 16);
    CHECK(IBV_MR_SET_LAYOUT_WITH_POST_WR == 1 && IBV_MR_SET_LAYOUT_AVOID_INVALIDATION == 2);
    CHECK(IBV_MR_SET_LAYOUT_FLAGS_SUPPORTED == 7);
    CHECK(IBV_MR_SET_LAYOUT_ERR_INPUT == -1 && IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE == -2 &&
          IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED == -3);

    memset(caps, 0, sizeof *caps);
    CHECK(ibv_query_mr_layout_caps(ctx, caps) == 0);
    uint64_t want = IBV_MR_SET_LAYOUT_SG | IBV_MR_SET_LAYOUT_INTERLEAVED |
                    IBV_MR_SET_LAYOUT_INTERLEAVED_REPEAT |
                    IBV_MR_SET_LAYOUT_INTERLEAVED_NONUNIFORM_REPEAT |
                    IBV_MR_SET_LAYOUT_INTERLEAVED_NONUNIFORM_DATUM_TOTAL |
                    IBV_MR_SET_LAYOUT_INTERNAL_REGISTRATION;
    CHECK((caps->cap_flags & want) == want);
    CHECK(caps->max_num_sg >= 17 && caps->max_inline_num_sg >= 2);
    CHECK(caps->max_inline_num_sg < caps->max_num_sg);
    CHECK(caps->max_num_interleaved >= 2 && caps->max_inline_num_interleaved >= 2);
    CHECK(caps->max_mr_stride_dimension >= 2);
    CHECK(caps->max_mr_stride_dimenson == caps->max_mr_stride_dimension);
    CHECK(caps->max_mr_nesting_level >= 2 && caps->max_mr_nesting_level < 16);
    /* Bad pointers. */
    struct ibv_mr_layout_caps c2;
    CHECK(ibv_query_mr_layout_caps(NULL, &c2) == EINVAL);
    CHECK(ibv_query_mr_layout_caps(ctx, NULL) == EINVAL);
    uint64_t fake[64] = {0};
    CHECK(ibv_query_mr_layout_caps((struct ibv_context *)fake, &c2) == EINVAL);
}

#define ITEMS 100
#define ITEM_LEN 8

/* The interleaved man-page example: items swapped pairwise, without touching memory. */
static void interleaved_example(void) {
    uint64_t *addr = aligned_alloc(64, ITEM_LEN * ITEMS);
    CHECK(addr);
    for (int i = 0; i < ITEMS; i++)
        addr[i] = 0x1000 + i;
    size_t item_len = ITEM_LEN;
    /* The man page's first_datum.addr values are offsets (item_len, 0), so its region is
     * zero-based here; everything else is as in the man page. */
    struct ibv_mr *contig_mr = ibv_reg_mr(pd, addr, item_len * 100, IBV_ACCESS_ZERO_BASED);
    if (!contig_mr) {
        fprintf(stderr, "Failed to create contiguous MR\n");
        exit(1);
    }
    struct ibv_mr *noncontig_mr = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    if (!noncontig_mr) {
        fprintf(stderr, "Failed to create non-contiguous MR\n");
        exit(1);
    }
    CHECK(noncontig_mr->length == 0 && noncontig_mr->lkey == noncontig_mr->rkey);

    struct ibv_mr_interleved_dimensions mr_ilv_dim = {
        .offset_stride = 2 * item_len, /* after item[x] take item[x+2] */
        .datum_count = 50
    };
    struct ibv_mr_interleaved mr_ilv[2] = {
        {
            .first_datum = {
                .addr = item_len, /* start with item[1] */
                .length = item_len,
                .lkey = contig_mr->lkey
            },
            .num_repeated = 1,
            .num_dimensions = 1,
            .dims = &mr_ilv_dim
        },
        {
            .first_datum = {
                .addr = 0, /* start with item[0] */
                .length = item_len,
                .lkey = contig_mr->lkey
            },
            .num_repeated = 1,
            .num_dimensions = 1,
            .dims = &mr_ilv_dim
        },
    };
    int ret = ibv_mr_set_layout_interleaved(noncontig_mr, 0, 2, mr_ilv);
    if (ret) {
        fprintf(stderr, "Non-contiguous registration failed\n");
        exit(1);
    }
    CHECK(noncontig_mr->length == item_len * 100);

    struct ibv_sge interleaved = {
        .addr = 0,
        .length = item_len * 100,
        .lkey = noncontig_mr->lkey
    };
    struct ibv_send_wr send_wr = {
        .opcode = IBV_WR_SEND,
        .num_sge = 1,
        .sg_list = &interleaved,
        .send_flags = IBV_SEND_SIGNALED
    }, *bad_wr;
    post_recv();
    ret = ibv_post_send(qa, &send_wr, &bad_wr);
    if (ret) {
        fprintf(stderr, "Non-contiguous send failed\n");
        exit(1);
    }
    expect_sent(0, item_len * 100);
    uint64_t got[ITEMS];
    memcpy(got, rbuf, sizeof got);
    for (int i = 0; i < ITEMS; i++)
        CHECK(got[i] == (uint64_t)(0x1000 + (i ^ 1)));
    /* Memory itself untouched; a part of the layout (items 3..6 of the swapped view). */
    for (int i = 0; i < ITEMS; i++)
        CHECK(addr[i] == (uint64_t)(0x1000 + i));
    uint64_t part[] = {0x1000 + 2, 0x1000 + 5, 0x1000 + 4, 0x1000 + 7};
    send_expect(noncontig_mr->lkey, 3 * ITEM_LEN, sizeof part, part);

    /* The reverse: an RDMA WRITE of contiguous items into the layout, by its rkey. */
    uint64_t *dst = aligned_alloc(64, ITEM_LEN * ITEMS);
    CHECK(dst);
    memset(dst, 0, ITEM_LEN * ITEMS);
    struct ibv_mr *dst_mr = ibv_reg_mr(pd, dst, ITEM_LEN * ITEMS,
                                       IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE |
                                           IBV_ACCESS_REMOTE_WRITE);
    struct ibv_mr *win = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE |
                                                     IBV_ACCESS_REMOTE_WRITE);
    CHECK(dst_mr && win);
    mr_ilv[0].first_datum.lkey = dst_mr->lkey;
    mr_ilv[1].first_datum.lkey = dst_mr->lkey;
    CHECK(ibv_mr_set_layout_interleaved(win, 0, 2, mr_ilv) == 0);
    struct ibv_sge src = {(uintptr_t)addr, ITEM_LEN * ITEMS, contig_mr->lkey};
    src.addr = 0; /* contig_mr is zero-based */
    struct ibv_send_wr w = {0};
    w.wr_id = 2;
    w.opcode = IBV_WR_RDMA_WRITE;
    w.sg_list = &src;
    w.num_sge = 1;
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.rdma.remote_addr = 0;
    w.wr.rdma.rkey = win->rkey;
    CHECK(ibv_post_send(qb, &w, &bad_wr) == 0);
    struct ibv_wc wc = poll1(cqb);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE && wc.wr_id == 2);
    for (int i = 0; i < ITEMS; i++)
        CHECK(dst[i] == (uint64_t)(0x1000 + (i ^ 1)));

    /* Dereg busy: the regions a layout uses stay registered until the layout goes. */
    errno = 0;
    CHECK(ibv_dereg_mr(contig_mr) == EBUSY);
    CHECK(ibv_dereg_mr(dst_mr) == EBUSY);
    send_expect(noncontig_mr->lkey, 0, 2 * ITEM_LEN, (uint64_t[]){0x1001, 0x1000});
    CHECK(ibv_dereg_mr(noncontig_mr) == 0);
    CHECK(ibv_dereg_mr(win) == 0);
    CHECK(ibv_dereg_mr(contig_mr) == 0);
    CHECK(ibv_dereg_mr(dst_mr) == 0);
    CHECK(ibv_dereg_mr(dst_mr) == EINVAL); /* already deregistered */
    free(addr);
    free(dst);
}

/* The SG man-page example: one send from two buffers of two MRs. */
static void sg_example(void) {
    size_t len1 = 100, len2 = 60;
    char *addr1 = malloc(len1), *addr2 = malloc(len2), want[160];
    CHECK(addr1 && addr2);
    for (size_t i = 0; i < len1; i++)
        addr1[i] = (char)('a' + i % 26);
    for (size_t i = 0; i < len2; i++)
        addr2[i] = (char)('A' + i % 26);
    memcpy(want, addr1, len1);
    memcpy(want + len1, addr2, len2);

    struct ibv_mr *mr1 = ibv_reg_mr(pd, addr1, len1, 0);
    if (!mr1) {
        fprintf(stderr, "Failed to create MR #1\n");
        exit(1);
    }
    struct ibv_mr *mr2 = ibv_reg_mr(pd, addr2, len2, 0);
    if (!mr2) {
        fprintf(stderr, "Failed to create MR #2\n");
        exit(1);
    }
    struct ibv_mr *mr3 = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    if (!mr3) {
        fprintf(stderr, "Failed to create result MR\n");
        exit(1);
    }
    struct ibv_sge composite[] = {
        {
            .addr = (uintptr_t)addr1,
            .length = len1,
            .lkey = mr1->lkey
        },
        {
            .addr = (uintptr_t)addr2,
            .length = len2,
            .lkey = mr2->lkey
        }
    };
    int ret = ibv_mr_set_layout_sg(mr3, 0, 2, composite);
    if (ret) {
        fprintf(stderr, "Non-contiguous registration failed\n");
        exit(1);
    }
    CHECK(mr3->length == len1 + len2);
    struct ibv_sge non_contig = {
        .addr = 0,
        .length = len1 + len2,
        .lkey = mr3->lkey
    };
    struct ibv_send_wr send_wr = {
        .opcode = IBV_WR_SEND,
        .num_sge = 1,
        .sg_list = &non_contig,
        .send_flags = IBV_SEND_SIGNALED
    }, *bad_wr;
    post_recv();
    ret = ibv_post_send(qa, &send_wr, &bad_wr);
    if (ret) {
        fprintf(stderr, "Non-contiguous send failed\n");
        exit(1);
    }
    expect_sent(0, len1 + len2);
    CHECK(memcmp(rbuf, want, len1 + len2) == 0);
    /* A range across the boundary. */
    send_expect(mr3->lkey, 90, 20, want + 90);

    /* The reply thread's variant: plain buffers registered inside the call (lkey 0). */
    struct ibv_mr *mr4 = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    CHECK(mr4);
    struct ibv_sge plain[] = {{(uintptr_t)addr1, len1, 0}, {(uintptr_t)addr2, len2, 0}};
    errno = 0;
    CHECK(ibv_mr_set_layout_sg(mr4, 0, 2, plain) == IBV_MR_SET_LAYOUT_ERR_INPUT);
    CHECK(errno == EINVAL); /* lkey 0 without the flag */
    CHECK(ibv_mr_set_layout_sg(mr4, IBV_MR_SET_LAYOUT_REGISTER_BUFFERS, 2, plain) == 0);
    send_expect(mr4->lkey, 0, len1 + len2, want);

    /* Nesting: an SG layout of [the last 10 bytes of mr3's layout, 5 bytes of mr1]. */
    struct ibv_mr *mr5 = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    CHECK(mr5);
    struct ibv_sge nested[] = {{150, 10, mr3->lkey}, {(uintptr_t)addr1, 5, mr1->lkey}};
    CHECK(ibv_mr_set_layout_sg(mr5, 0, 2, nested) == 0);
    char nwant[15];
    memcpy(nwant, want + 150, 10);
    memcpy(nwant + 10, addr1, 5);
    send_expect(mr5->lkey, 0, 15, nwant);
    CHECK(ibv_dereg_mr(mr3) == EBUSY); /* mr5 uses it */

    CHECK(ibv_dereg_mr(mr5) == 0);
    CHECK(ibv_dereg_mr(mr4) == 0);
    CHECK(ibv_dereg_mr(mr3) == 0);
    CHECK(ibv_dereg_mr(mr2) == 0);
    CHECK(ibv_dereg_mr(mr1) == 0);
    free(addr1);
    free(addr2);
}

/* WITH_POST_WR: the layout changes at the bind work request. */
static void post_wr(void) {
    char *buf = malloc(64);
    CHECK(buf);
    for (int i = 0; i < 64; i++)
        buf[i] = (char)i;
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 64, 0);
    struct ibv_mr *c = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    CHECK(mr && c);
    struct ibv_sge a[] = {{(uintptr_t)buf, 4, mr->lkey}, {(uintptr_t)buf + 32, 4, mr->lkey}};
    struct ibv_sge b[] = {{(uintptr_t)buf + 8, 4, mr->lkey}, {(uintptr_t)buf + 40, 2, mr->lkey}};
    CHECK(ibv_mr_set_layout_sg(c, 0, 2, a) == 0);
    char wa[] = {0, 1, 2, 3, 32, 33, 34, 35}, wb[] = {8, 9, 10, 11, 40, 41};
    send_expect(c->lkey, 0, 8, wa);
    uint32_t key = c->lkey;
    CHECK(ibv_mr_set_layout_sg(c, IBV_MR_SET_LAYOUT_WITH_POST_WR, 2, b) == 0);
    CHECK(c->lkey == key); /* same count: no key change */
    CHECK(c->length == 6);   /* the staged layout's */
    send_expect(c->lkey, 0, 8, wa); /* not bound yet: the old layout is in force */

    /* Bind, then a send posted right after it on the same QP sees the new layout. */
    post_recv();
    struct ibv_send_wr bind = {0}, send = {0}, *bad = NULL;
    ibv_wr_bind_mr(&bind, c);
    CHECK(bind.opcode == IBV_WR_DRIVER1);
    bind.wr_id = 11;
    bind.send_flags = IBV_SEND_SIGNALED;
    bind.next = &send;
    struct ibv_sge s = {0, 6, c->lkey};
    send.wr_id = 12;
    send.opcode = IBV_WR_SEND;
    send.sg_list = &s;
    send.num_sge = 1;
    send.send_flags = IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(qa, &bind, &bad) == 0);
    struct ibv_wc wc = poll1(cqa);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 11);
    wc = poll1(cqa);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.wr_id == 12);
    wc = poll1(cqb);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 6 && memcmp(rbuf, wb, 6) == 0);

    /* A bind naming anything but a live container is refused at post time. */
    ibv_wr_bind_mr(&bind, mr); /* a plain MR */
    bind.next = NULL;
    bad = NULL;
    CHECK(ibv_post_send(qa, &bind, &bad) == EINVAL && bad == &bind);
    bind.bind_mw.mw = NULL;
    CHECK(ibv_post_send(qa, &bind, &bad) == EINVAL);
    uint64_t fake[16] = {0};
    bind.bind_mw.mw = (struct ibv_mw *)fake;
    CHECK(ibv_post_send(qa, &bind, &bad) == EINVAL);

    CHECK(ibv_dereg_mr(c) == 0);
    CHECK(ibv_dereg_mr(mr) == 0);
    free(buf);
}

/* Every result code, key changes, and the old layout surviving failures. */
static void errors(const struct ibv_mr_layout_caps *caps) {
    enum { N = 4096 };
    char *buf = malloc(N);
    CHECK(buf);
    for (int i = 0; i < N; i++)
        buf[i] = (char)(i * 7 + 3);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, N, 0);
    struct ibv_mr *c = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
    CHECK(mr && c);
    struct ibv_sge two[] = {{(uintptr_t)buf + 100, 8, mr->lkey}, {(uintptr_t)buf, 8, mr->lkey}};
    CHECK(ibv_mr_set_layout_sg(c, 0, 2, two) == 0);
    char w2[16];
    memcpy(w2, buf + 100, 8);
    memcpy(w2 + 8, buf, 8);
    send_expect(c->lkey, 0, 16, w2);
    uint32_t key = c->lkey;

    /* IBV_MR_SET_LAYOUT_ERR_INPUT, errno EINVAL; the old layout and key stay. */
#define INPUT(call) do { errno = 0; CHECK((call) == IBV_MR_SET_LAYOUT_ERR_INPUT); CHECK(errno == EINVAL); } while (0)
    struct ibv_sge bad_key[] = {{(uintptr_t)buf, 8, 0xdeadbe00}};
    INPUT(ibv_mr_set_layout_sg(c, 0, 1, bad_key));
    struct ibv_sge outside[] = {{(uintptr_t)buf + N - 4, 8, mr->lkey}};
    INPUT(ibv_mr_set_layout_sg(c, 0, 1, outside));
    struct ibv_sge self[] = {{0, 8, c->lkey}};
    INPUT(ibv_mr_set_layout_sg(c, 0, 1, self));
    struct ibv_sge zero[] = {{(uintptr_t)buf, 0, mr->lkey}};
    INPUT(ibv_mr_set_layout_sg(c, 0, 1, zero));
    INPUT(ibv_mr_set_layout_sg(c, 0, 0, two));    /* no data */
    INPUT(ibv_mr_set_layout_sg(c, 0, -1, two));   /* negative count */
    INPUT(ibv_mr_set_layout_sg(c, 0, 2, NULL));   /* NULL list */
    INPUT(ibv_mr_set_layout_sg(NULL, 0, 2, two)); /* NULL mr */
    INPUT(ibv_mr_set_layout_sg(mr, 0, 2, two));   /* not a container */
    uint64_t fake[16] = {0};
    INPUT(ibv_mr_set_layout_sg((struct ibv_mr *)fake, 0, 2, two)); /* not ours */
    struct ibv_mr_layout_interleved_dimensions d[2] = {{16, 4}, {0, 0}};
    struct ibv_mr_layout_interleaved e = {{(uintptr_t)buf, 8, mr->lkey}, 1, {1}, d};
    e.num_dimensions = 0;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, &e)); /* no dimensions */
    e.num_dimensions = 2;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, &e)); /* datum_count 0 */
    e.num_dimensions = 1;
    e.num_repeated = 0;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, &e));
    e.num_repeated = -1;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, &e));
    e.num_repeated = 1;
    e.dims = NULL;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, &e));
    e.dims = d;
    INPUT(ibv_mr_set_layout_interleaved(c, 0, 1, NULL));
    CHECK(c->lkey == key && c->length == 16);
    send_expect(c->lkey, 0, 16, w2);

    /* IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED, errno EOPNOTSUPP. */
#define UNSUP(call) do { errno = 0; CHECK((call) == IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED); CHECK(errno == EOPNOTSUPP); } while (0)
    uint32_t nd = caps->max_mr_stride_dimension + 1;
    struct ibv_mr_layout_interleved_dimensions *many = calloc(nd, sizeof *many);
    CHECK(many);
    for (uint32_t i = 0; i < nd; i++)
        many[i] = (struct ibv_mr_layout_interleved_dimensions){8, 1};
    e.num_dimensions = (int)nd;
    e.dims = many;
    UNSUP(ibv_mr_set_layout_interleaved(c, 0, 1, &e)); /* too many dimensions */
    e.num_dimensions = (int)caps->max_mr_stride_dimension;
    CHECK(ibv_mr_set_layout_interleaved(c, 0, 1, &e) == 0); /* the maximum is fine */
    CHECK(c->length == 8);
    e.num_dimensions = 1;
    e.dims = d;
    struct ibv_sge *lots = calloc(caps->max_num_sg + 1, sizeof *lots);
    CHECK(lots);
    for (uint32_t i = 0; i <= caps->max_num_sg; i++)
        lots[i] = (struct ibv_sge){(uintptr_t)buf + i % N, 1, mr->lkey};
    UNSUP(ibv_mr_set_layout_sg(c, 0, (int)caps->max_num_sg + 1, lots)); /* too many SGEs */
    struct ibv_mr_layout_interleaved *ents = calloc(caps->max_num_interleaved + 1, sizeof *ents);
    CHECK(ents);
    for (uint32_t i = 0; i <= caps->max_num_interleaved; i++)
        ents[i] = e;
    UNSUP(ibv_mr_set_layout_interleaved(c, 0, (int)caps->max_num_interleaved + 1, ents));
    UNSUP(ibv_mr_set_layout_sg(c, 1 << 10, 2, two)); /* unknown flag */
    /* Nesting: each container an SG of the previous one; one level too deep fails. */
    struct ibv_mr *chain[16];
    uint32_t levels = caps->max_mr_nesting_level;
    CHECK(levels < 16);
    for (uint32_t i = 0; i <= levels; i++) {
        chain[i] = ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED);
        CHECK(chain[i]);
        struct ibv_sge s = i == 0 ? (struct ibv_sge){(uintptr_t)buf, 8, mr->lkey}
                                  : (struct ibv_sge){0, 8, chain[i - 1]->lkey};
        if (i < levels) {
            CHECK(ibv_mr_set_layout_sg(chain[i], 0, 1, &s) == 0);
        } else {
            UNSUP(ibv_mr_set_layout_sg(chain[i], 0, 1, &s));
        }
    }
    send_expect(chain[levels - 1]->lkey, 0, 8, buf); /* the deepest allowed works */
    for (int i = (int)levels; i >= 0; i--)
        CHECK(ibv_dereg_mr(chain[i]) == 0);
    CHECK(ibv_mr_set_layout_sg(c, 0, 2, two) == 0); /* back to the 2-SGE layout */
    CHECK(c->lkey == key);
    send_expect(c->lkey, 0, 16, w2);

    /* IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE, errno EBUSY: more SGEs than fit inline. */
    uint32_t big = caps->max_inline_num_sg + 1;
    char *wbig = malloc(big);
    CHECK(wbig);
    for (uint32_t i = 0; i < big; i++) {
        lots[i] = (struct ibv_sge){(uintptr_t)buf + 3 * i, 1, mr->lkey};
        wbig[i] = buf[3 * i];
    }
    errno = 0;
    CHECK(ibv_mr_set_layout_sg(c, IBV_MR_SET_LAYOUT_AVOID_INVALIDATION, (int)big, lots) ==
          IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE);
    CHECK(errno == EBUSY);
    CHECK(c->lkey == key && c->rkey == key && c->length == 16);
    send_expect(c->lkey, 0, 16, w2); /* the old layout, with the old key */

    /* Without the flag the keys change, and the ibv_mr shows it. */
    CHECK(ibv_mr_set_layout_sg(c, 0, (int)big, lots) == 0);
    CHECK(c->lkey != key && c->rkey == c->lkey && c->length == big);
    send_expect(c->lkey, 0, big, wbig);
    /* Now the room is there: the same size again keeps the key, even with the flag. */
    uint32_t key2 = c->lkey;
    CHECK(ibv_mr_set_layout_sg(c, IBV_MR_SET_LAYOUT_AVOID_INVALIDATION, (int)big, lots) == 0);
    CHECK(c->lkey == key2);
    CHECK(ibv_mr_set_layout_sg(c, IBV_MR_SET_LAYOUT_AVOID_INVALIDATION, 2, two) == 0);
    CHECK(c->lkey == key2 && c->length == 16);
    send_expect(c->lkey, 0, 16, w2);

    /* Dereg: busy while used, then inverse order; NULL and foreign pointers. Re-registering
     * is refused the same way, and a container cannot be re-registered at all. */
    CHECK(ibv_dereg_mr(mr) == EBUSY);
    errno = 0;
    CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) ==
              IBV_REREG_MR_ERR_INPUT &&
          errno == EBUSY);
    errno = 0;
    CHECK(ibv_rereg_mr(c, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) ==
              IBV_REREG_MR_ERR_INPUT &&
          errno == EINVAL);
    send_expect(c->lkey, 0, 16, w2);
    CHECK(ibv_dereg_mr(NULL) == EINVAL);
    CHECK(ibv_dereg_mr((struct ibv_mr *)fake) == EINVAL);

    /* Last, as it breaks the QP: the old key is dead (a local protection error). */
    post_recv();
    post_send1(99, key, 0, 16);
    struct ibv_wc wc = poll1(cqa);
    CHECK(wc.wr_id == 99 && wc.status == IBV_WC_LOC_PROT_ERR);

    CHECK(ibv_dereg_mr(c) == 0);
    CHECK(ibv_dereg_mr(mr) == 0);
    free(many);
    free(lots);
    free(ents);
    free(wbig);
    free(buf);
}

/* ibv_reg_mr_pages: pages out of order, from an offset into the first, at a chosen IOVA;
 * ibv_reg_mr_bitmap: the pages a bitmap selects, zero-based. Each region is sent from with one
 * SGE and received contiguous, and RDMA-written into by rkey. Bad arguments: NULL, EINVAL. */
static void pages_and_bitmap(void) {
    enum { PG = 4096 };
    char *buf = aligned_alloc(PG, 8 * PG);
    char *want = malloc(2 * PG);
    CHECK(buf && want);
    for (int i = 0; i < 8 * PG; i++)
        buf[i] = (char)(i / PG * 16 + i % 13);
    int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

    void *pages[3] = {buf + 5 * PG, buf + 2 * PG, buf + 6 * PG};
    uint64_t iova = 0x10000000;
    struct ibv_mr *pl = ibv_reg_mr_pages(pd, pages, 3, PG, 100, 2 * PG, iova, acc);
    CHECK(pl);
    CHECK(pl->length == 2 * PG && (uint64_t)(uintptr_t)pl->addr == iova && pl->lkey == pl->rkey);
    memcpy(want, buf + 5 * PG + 100, PG - 100);
    memcpy(want + PG - 100, buf + 2 * PG, PG);
    memcpy(want + 2 * PG - 100, buf + 6 * PG, 100);
    send_expect(pl->lkey, iova, 2 * PG, want);

    /* Pages 1, 3, 4 and 7; bytes 2 * PG.. of the region are pages 4 and 7. */
    uint64_t bits = (1u << 1) | (1u << 3) | (1u << 4) | (1u << 7);
    struct ibv_mr *bm = ibv_reg_mr_bitmap(pd, buf, PG, &bits, 1, 0, acc | IBV_ACCESS_ZERO_BASED);
    CHECK(bm);
    CHECK(bm->length == 4 * PG && bm->addr == NULL);
    memcpy(want, buf + 4 * PG, PG);
    memcpy(want + PG, buf + 7 * PG, PG);
    send_expect(bm->lkey, 2 * PG, 2 * PG, want);

    /* An RDMA WRITE by rkey across the page boundary of the list lands in pages 5 and 2. */
    memset(rbuf, 0x5a, 64);
    struct ibv_sge s = {(uintptr_t)rbuf, 64, rmr->lkey};
    struct ibv_send_wr w = {0}, *bad = NULL;
    w.wr_id = 2;
    w.opcode = IBV_WR_RDMA_WRITE;
    w.sg_list = &s;
    w.num_sge = 1;
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.rdma.remote_addr = iova + PG - 100 - 32;
    w.wr.rdma.rkey = pl->rkey;
    CHECK(ibv_post_send(qa, &w, &bad) == 0);
    struct ibv_wc wc = poll1(cqa);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2);
    for (int i = 0; i < 32; i++)
        CHECK(buf[6 * PG - 32 + i] == 0x5a && buf[2 * PG + i] == 0x5a);
    CHECK(buf[6 * PG - 33] != 0x5a && buf[2 * PG + 32] != 0x5a);

    errno = 0;
    CHECK(!ibv_reg_mr_pages(NULL, pages, 3, PG, 0, PG, 0, acc) && errno == EINVAL);
    errno = 0;
    CHECK(!ibv_reg_mr_pages(pd, NULL, 3, PG, 0, PG, 0, acc) && errno == EINVAL);
    errno = 0;
    CHECK(!ibv_reg_mr_pages(pd, pages, 0, PG, 0, PG, 0, acc) && errno == EINVAL);
    void *crooked[1] = {buf + 1};
    errno = 0;
    CHECK(!ibv_reg_mr_pages(pd, crooked, 1, PG, 0, 10, 0, acc) && errno == EINVAL);
    errno = 0; /* longer than the pages */
    CHECK(!ibv_reg_mr_pages(pd, pages, 1, PG, 0, 2 * PG, 0, acc) && errno == EINVAL);
    uint64_t none[2] = {0, 0};
    errno = 0;
    CHECK(!ibv_reg_mr_bitmap(pd, buf, PG, none, 2, 0, acc) && errno == EINVAL);
    errno = 0;
    CHECK(!ibv_reg_mr_bitmap(pd, buf, PG, NULL, 1, 0, acc) && errno == EINVAL);
    errno = 0;
    CHECK(!ibv_reg_mr_bitmap(pd, buf + 8, PG, &bits, 1, 0, acc) && errno == EINVAL);

    CHECK(ibv_dereg_mr(bm) == 0 && ibv_dereg_mr(pl) == 0);
    free(want);
    free(buf);
}

int main(void) {
    setup();
    struct ibv_mr_layout_caps caps;
    caps_query(&caps);
    interleaved_example();
    sg_example();
    post_wr();
    pages_and_bitmap();
    errors(&caps); /* last: it breaks the QP */
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_dereg_mr(rmr) == 0);
    CHECK(ibv_destroy_cq(cqa) == 0 && ibv_destroy_cq(cqb) == 0);
    CHECK(ibv_dealloc_pd(pd) == 0);
    CHECK(ibv_close_device(ctx) == 0);
    free(rbuf);
    printf("ok\n");
    return 0;
}
