/* Conformance of the drop-in with the libibverbs man pages and the kernel's answers, one call
 * family per run (`conformance FAMILY`), built against Debian's <infiniband/verbs.h> alone:
 *
 *   mr     ibv_reg_mr / ibv_rereg_mr of memory that is not mapped, only partly mapped,
 *          PROT_NONE, or read-only with a right that writes: NULL / IBV_REREG_MR_ERR_INPUT
 *          with EFAULT, as the kernel's page pinning answers; read-only memory with read
 *          rights registers; the old region survives a failed re-registration.
 *   busy   ibv_dealloc_pd, ibv_destroy_cq and ibv_destroy_srq of objects still in use:
 *          EBUSY, and each object stays usable; in the right order every destroy succeeds.
 *   post   ibv_post_send / ibv_post_recv / ibv_post_srq_recv with more SGEs than the queue
 *          allows, and inline data longer than max_inline_data: EINVAL and bad_wr set, with
 *          the caller's array and bytes never read past what the queue allows (they end at a
 *          PROT_NONE guard page, so a read past them kills the program); then valid traffic.
 *   cq     ibv_create_cq / ibv_create_cq_ex with a completion vector the device does not
 *          have, and out-of-range sizes: NULL with EINVAL; every vector it has works.
 *
 * Prints "ok" at the end; any failed CHECK exits 1 with the line. */
#include "common.h"
#include <sys/mman.h>
#include <unistd.h>

static size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

/* `n` pages: `prot` for the first `n - 1`, the last a PROT_NONE guard. */
static char *pages_with_guard(size_t n, int prot) {
    size_t pg = page_size();
    char *p = mmap(NULL, n * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    memset(p, 0x5a, (n - 1) * pg);
    CHECK(mprotect(p, (n - 1) * pg, prot) == 0);
    CHECK(mprotect(p + (n - 1) * pg, pg, PROT_NONE) == 0);
    return p;
}

static void expect_efault(struct ibv_pd *pd, void *addr, size_t len, int access) {
    errno = 0;
    struct ibv_mr *mr = ibv_reg_mr(pd, addr, len, access);
    if (mr)
        fprintf(stderr, "registered %zu bytes at %p with access %#x\n", len, addr, access);
    CHECK(mr == NULL && errno == EFAULT);
}

static void family_mr(struct ibv_context *ctx) {
    size_t pg = page_size();
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd);
    expect_efault(pd, NULL, 4096, IBV_ACCESS_LOCAL_WRITE);
    expect_efault(pd, NULL, 4096, 0);

    /* Unmapped after mmap; a range whose second page is unmapped. */
    char *two = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(two != MAP_FAILED);
    CHECK(munmap(two + pg, pg) == 0);
    expect_efault(pd, two + pg, pg, IBV_ACCESS_LOCAL_WRITE);
    expect_efault(pd, two, 2 * pg, IBV_ACCESS_LOCAL_WRITE);
    expect_efault(pd, two + pg - 8, 16, 0);
    struct ibv_mr *ok = ibv_reg_mr(pd, two, pg, IBV_ACCESS_LOCAL_WRITE);
    CHECK(ok);

    /* Read-only memory: no right that writes into it; read rights register. */
    char *ro = pages_with_guard(2, PROT_READ);
    expect_efault(pd, ro, pg, IBV_ACCESS_LOCAL_WRITE);
    expect_efault(pd, ro, pg, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    expect_efault(pd, ro, pg, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
    struct ibv_mr *rd = ibv_reg_mr(pd, ro, pg, IBV_ACCESS_REMOTE_READ);
    CHECK(rd);
    /* PROT_NONE: not even read rights. */
    expect_efault(pd, ro + pg, pg, 0);
    expect_efault(pd, ro, 2 * pg, IBV_ACCESS_REMOTE_READ);

    /* A re-registration onto unmapped memory fails and leaves the region as it was. */
    uint32_t lkey = ok->lkey;
    errno = 0;
    CHECK(ibv_rereg_mr(ok, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, two + pg, pg,
                       IBV_ACCESS_LOCAL_WRITE) == IBV_REREG_MR_ERR_INPUT &&
          errno == EFAULT);
    CHECK(ok->lkey == lkey && ok->addr == two);
    /* ... onto read-only memory with the write right kept: the same. */
    errno = 0;
    CHECK(ibv_rereg_mr(ok, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, ro, pg, 0) ==
              IBV_REREG_MR_ERR_INPUT &&
          errno == EFAULT);
    CHECK(ibv_dereg_mr(rd) == 0 && ibv_dereg_mr(ok) == 0);
    CHECK(ibv_dealloc_pd(pd) == 0);
    munmap(two, pg);
    munmap(ro, 2 * pg);
}

static void family_busy(struct ibv_context *ctx) {
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(pd && cq);
    char buf[64];
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr);
    errno = 0;
    CHECK(ibv_dealloc_pd(pd) == EBUSY);
    /* Still a PD: it takes another registration. */
    struct ibv_mr *mr2 = ibv_reg_mr(pd, buf, sizeof buf, 0);
    CHECK(mr2 && ibv_dereg_mr(mr2) == 0);

    struct ibv_srq_init_attr sa = {0};
    sa.attr.max_wr = 4;
    sa.attr.max_sge = 1;
    struct ibv_srq *srq = ibv_create_srq(pd, &sa);
    CHECK(srq);
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.srq = srq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 4;
    ia.cap.max_send_sge = 1;
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    CHECK(qp);
    CHECK(ibv_destroy_cq(cq) == EBUSY);
    CHECK(ibv_destroy_srq(srq) == EBUSY);
    /* Still a CQ and an SRQ. */
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(cq, 1, &wc) == 0);
    struct ibv_sge sge = {(uintptr_t)buf, sizeof buf, mr->lkey};
    struct ibv_recv_wr rw = {0}, *bad = NULL;
    rw.sg_list = &sge;
    rw.num_sge = 1;
    CHECK(ibv_post_srq_recv(srq, &rw, &bad) == 0);

    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct ibv_ah_attr aa = {0};
    aa.is_global = 1;
    aa.grh.dgid = gid;
    aa.grh.hop_limit = 1;
    aa.port_num = 1;
    struct ibv_ah *ah = ibv_create_ah(pd, &aa);
    CHECK(ah);

    CHECK(ibv_destroy_qp(qp) == 0);
    CHECK(ibv_destroy_srq(srq) == 0 && ibv_destroy_cq(cq) == 0);
    CHECK(ibv_dereg_mr(mr) == 0);
    CHECK(ibv_dealloc_pd(pd) == EBUSY); /* the address handle */
    CHECK(ibv_destroy_ah(ah) == 0);
    CHECK(ibv_dealloc_pd(pd) == 0);
}

static void family_post(struct ibv_context *ctx) {
    size_t pg = page_size();
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(pd && cq);
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 8;
    ia.cap.max_recv_wr = 8;
    ia.cap.max_send_sge = 2;
    ia.cap.max_recv_sge = 2;
    ia.cap.max_inline_data = 32;
    struct ibv_qp *qa = ibv_create_qp(pd, &ia);
    CHECK(qa);
    struct ibv_qp_cap cap = ia.cap; /* as created (written back) */
    struct ibv_qp *qb = ibv_create_qp(pd, &ia);
    CHECK(qb);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    connect_rc_pair(qa, qb, &gid, RC_ACCESS_ALL);

    char *buf = malloc(4096);
    CHECK(buf);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, RC_ACCESS_ALL);
    CHECK(mr);
    /* The SGE arrays end at a guard page: exactly `max` readable entries. */
    char *guarded = pages_with_guard(2, PROT_READ | PROT_WRITE);
    unsigned max = cap.max_send_sge > cap.max_recv_sge ? cap.max_send_sge : cap.max_recv_sge;
    struct ibv_sge *sges = (struct ibv_sge *)(guarded + pg) - max;
    for (unsigned i = 0; i < max; i++)
        sges[i] = (struct ibv_sge){(uintptr_t)buf + 64 * i, 64, mr->lkey};

    struct ibv_recv_wr rw = {0}, *rbad = NULL;
    rw.sg_list = sges + (max - cap.max_recv_sge);
    rw.num_sge = (int)cap.max_recv_sge + 1;
    CHECK(ibv_post_recv(qb, &rw, &rbad) == EINVAL && rbad == &rw);
    /* A receive for the SEND that gets through below, with every SGE it may have. */
    memset(buf, 0, 4096);
    rw.num_sge = (int)cap.max_recv_sge;
    CHECK(ibv_post_recv(qb, &rw, &rbad) == 0);

    struct ibv_send_wr sw = {0}, *sbad = NULL;
    sw.opcode = IBV_WR_SEND;
    sw.sg_list = sges + (max - cap.max_send_sge);
    sw.num_sge = (int)cap.max_send_sge + 1;
    CHECK(ibv_post_send(qa, &sw, &sbad) == EINVAL && sbad == &sw);
    sw.num_sge = 1000000;
    sbad = NULL;
    CHECK(ibv_post_send(qa, &sw, &sbad) == EINVAL && sbad == &sw);
    /* The second WR of a list is the bad one; the first is posted. */
    struct ibv_send_wr first = {0};
    first.wr_id = 1;
    first.opcode = IBV_WR_SEND;
    first.sg_list = sges + max - 1;
    first.num_sge = 1;
    first.send_flags = IBV_SEND_SIGNALED;
    first.next = &sw;
    sw.num_sge = (int)cap.max_send_sge + 1;
    sbad = NULL;
    CHECK(ibv_post_send(qa, &first, &sbad) == EINVAL && sbad == &sw);


    /* Inline data longer than the QP allows: its bytes (at the guard page) are never read. */
    struct ibv_sge inl = {(uintptr_t)(guarded + pg), cap.max_inline_data + 1, 0};
    struct ibv_send_wr iw = {0};
    iw.opcode = IBV_WR_SEND;
    iw.send_flags = IBV_SEND_INLINE;
    iw.sg_list = &inl;
    iw.num_sge = 1;
    sbad = NULL;
    CHECK(ibv_post_send(qa, &iw, &sbad) == EINVAL && sbad == &iw);

    /* SRQ: the same rule with its own max_sge. */
    struct ibv_srq_init_attr sa = {0};
    sa.attr.max_wr = 4;
    sa.attr.max_sge = 1;
    struct ibv_srq *srq = ibv_create_srq(pd, &sa);
    CHECK(srq);
    struct ibv_recv_wr srw = {0};
    srw.sg_list = (struct ibv_sge *)(guarded + pg) - sa.attr.max_sge;
    srw.num_sge = (int)sa.attr.max_sge + 1;
    rbad = NULL;
    CHECK(ibv_post_srq_recv(srq, &srw, &rbad) == EINVAL && rbad == &srw);

    /* The QPs still work: the first SEND of the list above landed in that receive. */
    int sent = 0, received = 0;
    for (int i = 0; i < 2; i++) {
        struct ibv_wc wc = poll1(cq);
        CHECK(wc.status == IBV_WC_SUCCESS);
        sent += wc.opcode == IBV_WC_SEND && wc.wr_id == 1;
        received += wc.opcode == IBV_WC_RECV && wc.byte_len == 64;
    }
    CHECK(sent == 1 && received == 1);

    CHECK(ibv_destroy_srq(srq) == 0);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
    free(buf);
    munmap(guarded, 2 * pg);
}

static void family_cq(struct ibv_context *ctx) {
    CHECK(ctx->num_comp_vectors >= 1);
    for (int v = 0; v < ctx->num_comp_vectors; v++) {
        struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, v);
        CHECK(cq && ibv_destroy_cq(cq) == 0);
    }
    int bad_vectors[] = {ctx->num_comp_vectors, -1, 1 << 20};
    for (unsigned i = 0; i < sizeof bad_vectors / sizeof bad_vectors[0]; i++) {
        errno = 0;
        CHECK(ibv_create_cq(ctx, 4, NULL, NULL, bad_vectors[i]) == NULL && errno == EINVAL);
    }
    struct ibv_cq_init_attr_ex ca = {0};
    ca.cqe = 4;
    ca.comp_vector = (uint32_t)ctx->num_comp_vectors;
    errno = 0;
    CHECK(ibv_create_cq_ex(ctx, &ca) == NULL && errno == EINVAL);
    ca.comp_vector = (uint32_t)ctx->num_comp_vectors - 1;
    struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
    CHECK(cqx && ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0);

    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0);
    errno = 0;
    CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ibv_create_cq(ctx, da.max_cqe + 1, NULL, NULL, 0) == NULL && errno == EINVAL);
    struct ibv_cq *big = ibv_create_cq(ctx, da.max_cqe, NULL, NULL, 0);
    CHECK(big && big->cqe >= da.max_cqe && ibv_destroy_cq(big) == 0);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    struct ibv_context *ctx = open_first_device();
    if (!strcmp(argv[1], "mr"))
        family_mr(ctx);
    else if (!strcmp(argv[1], "busy"))
        family_busy(ctx);
    else if (!strcmp(argv[1], "post"))
        family_post(ctx);
    else if (!strcmp(argv[1], "cq"))
        family_cq(ctx);
    else
        CHECK(!"a known family");
    CHECK(ibv_close_device(ctx) == 0);
    printf("ok\n");
    return 0;
}
