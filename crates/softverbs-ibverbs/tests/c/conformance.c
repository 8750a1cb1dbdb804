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
 *   query  ibv_query_device / _ex / ibv_query_port / ibv_query_gid / ibv_query_pkey: non-zero
 *          vendor and part ids, the _ex call's orig_attr the same as the plain one, no
 *          capability advertised that is not implemented (type-2A windows),
 *          the CM supported on the port, bad port, GID and P_Key indexes refused.
 *   odp    on-demand paging: the caps; RDMA WRITE and READ into memory never touched, through
 *          an explicit region and an implicit one over the whole address space (also an
 *          atomic and a SEND from unregistered memory); memory unmapped after registration
 *          gives IBV_WC_REM_ACCESS_ERR; ibv_advise_mr prefetches, refuses a non-ODP region
 *          (EINVAL) and unmapped memory (EFAULT).
 *   qp     ibv_create_qp with each capacity over the device's limit, without CQs, or of an
 *          unknown type: NULL with EINVAL; at the limits it works.
 *   dereg  ibv_dereg_mr of a region another thread's RDMA WRITEs read: when it returns, no
 *          access through the region is under way or starts (the memory is unmapped at
 *          once); the writer's next request completes with IBV_WC_LOC_PROT_ERR.
 *   rereg  ibv_rereg_mr with each of the seven flag combinations, each followed by traffic
 *          with the keys it returns: an RDMA WRITE lands in the new translation through a QP
 *          of the new PD, and an RDMA READ works exactly when the new rights allow it.
 *   awrite RDMA ATOMIC WRITE: the device cap (IB_UVERBS_DEVICE_ATOMIC_WRITE, bit 40 of
 *          device_cap_flags_ex), ibv_wr_atomic_write on a QP made with
 *          IBV_QP_EX_WITH_ATOMIC_WRITE and IBV_WR_ATOMIC_WRITE through ibv_post_send (one SGE
 *          of the 8 bytes, as soft-RoCE's provider takes it): the word is stored and the
 *          completion is IBV_WC_ATOMIC_WRITE; a region without REMOTE_WRITE is
 *          IBV_WC_REM_ACCESS_ERR; a misaligned address or a UD QP is EINVAL.
 *   flush  RDMA FLUSH through rdma-core 45's ibv_wr_flush, which Debian's rdma-core 44 headers
 *          lack: declared here as the newer header has it (wr_flush right after
 *          wr_atomic_write, IBV_QP_EX_WITH_FLUSH bit 11, IBV_ACCESS_FLUSH_GLOBAL bit 8,
 *          IBV_WC_FLUSH 8), as a program built against them calls it. The cap
 *          (IB_UVERBS_DEVICE_FLUSH_GLOBAL, bit 38); a WRITE then a FLUSH of its range and one of
 *          the whole region complete in order with IBV_WC_FLUSH; a region without
 *          FLUSH_GLOBAL is IBV_WC_REM_ACCESS_ERR; persistent placement is EOPNOTSUPP and a
 *          bad type EINVAL at ibv_wr_complete.
 *   mw     memory windows: the caps; a type-2 window bound through IBV_WR_BIND_MW over part
 *          of a region that has no remote rights is the only rkey to that part; a WRITE,
 *          a SEND with Invalidate and a WRITE posted together: the first lands, the receive
 *          reports IBV_WC_WITH_INV and the rkey, the last is IBV_WC_REM_ACCESS_ERR;
 *          ibv_dereg_mr is EBUSY while a window is bound; a type-1 window bound with
 *          ibv_bind_mw (mw->rkey incremented) by any QP of its PD; ibv_wr_bind_mw,
 *          ibv_wr_send_inv and ibv_wr_local_inv; a bind by a QP of another PD or over a
 *          region without MW_BIND completes with IBV_WC_MW_BIND_ERR; ibv_bind_mw of a
 *          type-2 window and an IBV_WR_BIND_MW naming no window of ours are EINVAL.
 *   mcast  UD multicast: the caps; a SEND to the multicast QPN through an AH naming the group
 *          reaches the attached QPs only, with the group as the GRH's destination;
 *          attaching twice is 0; a non-multicast GID, a QP that is not UD and detaching what
 *          is not attached are EINVAL; ibv_destroy_qp of an attached QP is EBUSY.
 *   xrc    XRC: the cap; ibv_open_xrcd by file (O_CREAT; O_EXCL on an existing domain and a
 *          mask without IBV_XRCD_INIT_ATTR_OFLAGS are EINVAL), two XRC SRQs
 *          (ibv_create_srq_ex) with their numbers (ibv_get_srq_num), an IBV_QPT_XRC_SEND
 *          initiator without a receive CQ and an IBV_QPT_XRC_RECV target
 *          (ibv_create_qp_ex with IBV_QP_INIT_ATTR_XRCD) connected with the kernel's masks
 *          (an initiator's RTR refuses IBV_QP_MIN_RNR_TIMER): a SEND through
 *          ibv_post_send (qp_type.xrc.remote_srqn) and one through ibv_wr_set_xrc_srqn land
 *          in the SRQ each names, completing with the target's QP number; an RDMA WRITE
 *          lands with a key of the SRQ's PD; ibv_open_qp gives the target by number; an SRQ
 *          number outside the domain is IBV_WC_REM_INV_REQ_ERR; receives on XRC QPs and
 *          an XRC_RECV QP from ibv_create_qp are EINVAL; ibv_close_xrcd and destroying the
 *          SRQ's CQ are EBUSY while the domain's objects live, then every destroy succeeds.
 *   import shared PDs: cmd_fd is a real descriptor; a child process (this program again, the
 *          dup'd cmd_fd inherited) imports the context (ibv_import_device), the PD
 *          (ibv_import_pd) and a region (ibv_import_mr: same keys, address and length), and
 *          sends from that region, which is the parent's memory, through a QP it made in the
 *          imported PD to a QP of the parent; a bad PD or region handle, ibv_import_pd on a
 *          context that was not imported, and ibv_reg_mr in an imported PD fail; then
 *          ibv_unimport_mr and ibv_unimport_pd.
 *   events the asynchronous events errors raise: IBV_EVENT_QP_REQ_ERR on a responder whose QP
 *          refuses a WRITE it does not allow, IBV_EVENT_QP_LAST_WQE_REACHED on an SRQ's QP
 *          moved to the error state, IBV_EVENT_CQ_ERR on a CQ that overflows; each names its
 *          object, and nothing else is queued.
 *   dm     device memory: max_dm_size; ibv_alloc_dm, ibv_memcpy_to_dm/_from_dm, a zero-based
 *          ibv_reg_dm_mr region that RDMA READ, WRITE and an atomic reach; its errors
 *          (no ZERO_BASED, out of range, over max_dm_size: EINVAL/ENOMEM; free while a
 *          region lies in it: EBUSY).
 *   domain thread and parent domains: a parent domain is its PD to every check (a QP made in
 *          it talks to one made in the PD, through a region registered in either), a CQ may
 *          name it; EBUSY for the thread domain and the PD while it exists, and for it while
 *          objects live; its allocators are never called (see domain.rs).
 *   srq_ah ibv_create_srq / ibv_modify_srq over the device's limits, ibv_create_ah with a bad
 *          port, a GID index past the table or (on RoCE) no GRH: EINVAL; ibv_query_srq and
 *          ibv_query_qp give back what was set.
 *   fork   ibv_fork_init / ibv_is_fork_initialized: IBV_FORK_UNNEEDED, and true: a child made
 *          by fork writes its own copy of registered memory (the parent's bytes do not
 *          change), and RDMA into the parent's region still lands after the fork.
 *   modify ibv_modify_qp per transition (IBTA 11.2.5 / the kernel's qp_state_table): a
 *          required attribute missing, an attribute the transition does not take, a bad
 *          port, MTU, access flag or read/atomic depth: EINVAL and the QP left in its state;
 *          the minimal masks work.
 *
 * Prints "ok" at the end; any failed CHECK exits 1 with the line. */
#include "common.h"
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
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
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 4, 1);
    ia.srq = srq;
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
    struct ibv_ah_attr aa = ah_to(&gid);
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
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 8, 2);
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

static void family_query(struct ibv_context *ctx) {
    struct ibv_device_attr a;
    CHECK(ibv_query_device(ctx, &a) == 0);
    CHECK(a.vendor_id != 0 && a.vendor_part_id != 0 && a.phys_port_cnt == 1);
    CHECK(a.max_qp > 0 && a.max_cq > 0 && a.max_mr > 0 && a.max_pd > 0 && a.max_sge > 0);
    /* Not implemented, so not advertised: type-2A windows, fast-register regions. Windows
     * of type 1 and 2B, multicast and XRC are (the mw, mcast and xrc families use them). */
    CHECK(a.max_mcast_grp > 0 && a.max_mcast_qp_attach > 0);
    CHECK((a.device_cap_flags &
           (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_MGT_EXTENSIONS)) == 0);
    CHECK(a.device_cap_flags & IBV_DEVICE_XRC);
    CHECK((a.device_cap_flags & IBV_DEVICE_MEM_WINDOW) && a.max_mw > 0);
    struct ibv_device_attr_ex x;
    memset(&x, 0xa5, sizeof x);
    CHECK(ibv_query_device_ex(ctx, NULL, &x) == 0);
    /* Field by field: the structs have padding. */
    const struct ibv_device_attr *o = &x.orig_attr;
    CHECK(!strcmp(o->fw_ver, a.fw_ver) && o->node_guid == a.node_guid &&
          o->sys_image_guid == a.sys_image_guid && o->max_mr_size == a.max_mr_size &&
          o->page_size_cap == a.page_size_cap && o->vendor_id == a.vendor_id &&
          o->vendor_part_id == a.vendor_part_id && o->hw_ver == a.hw_ver);
    CHECK(o->max_qp == a.max_qp && o->max_qp_wr == a.max_qp_wr &&
          o->device_cap_flags == a.device_cap_flags && o->max_sge == a.max_sge &&
          o->max_sge_rd == a.max_sge_rd && o->max_cq == a.max_cq && o->max_cqe == a.max_cqe &&
          o->max_mr == a.max_mr && o->max_pd == a.max_pd && o->max_qp_rd_atom == a.max_qp_rd_atom &&
          o->max_res_rd_atom == a.max_res_rd_atom &&
          o->max_qp_init_rd_atom == a.max_qp_init_rd_atom && o->atomic_cap == a.atomic_cap);
    CHECK(o->max_mw == a.max_mw && o->max_ah == a.max_ah && o->max_srq == a.max_srq &&
          o->max_srq_wr == a.max_srq_wr && o->max_srq_sge == a.max_srq_sge &&
          o->max_pkeys == a.max_pkeys && o->local_ca_ack_delay == a.local_ca_ack_delay &&
          o->phys_port_cnt == a.phys_port_cnt && o->max_mcast_grp == a.max_mcast_grp);
    /* On-demand paging is implemented (the odp family uses it): advertised. */
    CHECK(x.odp_caps.general_caps & IBV_ODP_SUPPORT);
    CHECK((x.device_cap_flags_ex & 0xffffffffu) == a.device_cap_flags);

    struct ibv_port_attr p;
    CHECK(ibv_query_port(ctx, 1, &p) == 0);
    CHECK(p.state == IBV_PORT_ACTIVE && p.gid_tbl_len >= 1 && p.pkey_tbl_len == 1);
    CHECK(p.port_cap_flags & IBV_PORT_CM_SUP);
    if (p.link_layer == IBV_LINK_LAYER_ETHERNET)
        CHECK(p.port_cap_flags & IBV_PORT_IP_BASED_GIDS);
    CHECK(ibv_query_port(ctx, 0, &p) != 0 && ibv_query_port(ctx, 2, &p) != 0);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    CHECK(ibv_query_gid(ctx, 1, p.gid_tbl_len, &gid) != 0 && ibv_query_gid(ctx, 2, 0, &gid) != 0);
    uint16_t pkey;
    CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == 0xffff);
    CHECK(ibv_query_pkey(ctx, 1, 1, &pkey) != 0);
}

static void family_qp(struct ibv_context *ctx) {
    struct ibv_device_attr a;
    CHECK(ibv_query_device(ctx, &a) == 0);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(pd && cq);
    struct ibv_qp_init_attr base = rc_init_attr(cq, 1, 1);
    struct ibv_qp_init_attr ia;
#define REFUSED(field, value)                                                                  \
    do {                                                                                       \
        ia = base;                                                                             \
        ia.field = value;                                                                      \
        errno = 0;                                                                             \
        struct ibv_qp *q = ibv_create_qp(pd, &ia);                                             \
        if (q)                                                                                 \
            fprintf(stderr, "created a QP with " #field " = %ld\n", (long)(value));          \
        CHECK(q == NULL && errno == EINVAL);                                                   \
    } while (0)
    REFUSED(cap.max_send_wr, (uint32_t)a.max_qp_wr + 1);
    REFUSED(cap.max_recv_wr, (uint32_t)a.max_qp_wr + 1);
    REFUSED(cap.max_send_sge, (uint32_t)a.max_sge + 1);
    REFUSED(cap.max_recv_sge, (uint32_t)a.max_sge + 1);
    REFUSED(cap.max_inline_data, 1u << 30);
    REFUSED(send_cq, NULL);
    REFUSED(recv_cq, NULL);
#undef REFUSED
    /* An unknown type: EINVAL, or EOPNOTSUPP as soft-RoCE answers types it lacks. */
    ia = base;
    ia.qp_type = 99;
    errno = 0;
    CHECK(ibv_create_qp(pd, &ia) == NULL && (errno == EINVAL || errno == EOPNOTSUPP));
    ia = base;
    ia.cap.max_send_wr = (uint32_t)a.max_qp_wr;
    ia.cap.max_recv_wr = (uint32_t)a.max_qp_wr;
    ia.cap.max_send_sge = (uint32_t)a.max_sge;
    ia.cap.max_recv_sge = (uint32_t)a.max_sge;
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    CHECK(qp);
    CHECK(ia.cap.max_send_wr >= (uint32_t)a.max_qp_wr && ia.cap.max_send_sge >= (uint32_t)a.max_sge);
    CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
}

static enum ibv_qp_state state_of(struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia) == 0);
    return a.qp_state;
}

/* ibv_modify_qp(qp, a, mask) must fail with EINVAL and leave the state as it was. */
static void refused(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, int line) {
    enum ibv_qp_state before = state_of(qp);
    int r = ibv_modify_qp(qp, a, mask);
    if (r != EINVAL)
        fprintf(stderr, "line %d: ibv_modify_qp returned %d, not EINVAL\n", line, r);
    CHECK(r == EINVAL && state_of(qp) == before);
}
#define REFUSED(qp, a, mask) refused(qp, a, mask, __LINE__)

static void family_modify(struct ibv_context *ctx) {
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(pd && cq);
    struct ibv_qp *qa, *qb;
    create_rc_pair(pd, cq, &qa, &qb);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);

    /* RESET -> INIT: PKEY_INDEX, PORT, ACCESS_FLAGS are required. */
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
    REFUSED(qa, &a, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    REFUSED(qa, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS);
    REFUSED(qa, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT);
    int init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    /* ... and takes nothing of RTR's or RTS's. */
    a.sq_psn = 1;
    REFUSED(qa, &a, init | IBV_QP_SQ_PSN);
    REFUSED(qa, &a, init | IBV_QP_DEST_QPN);
    a.port_num = 2;
    REFUSED(qa, &a, init);
    a.port_num = 0;
    REFUSED(qa, &a, init);
    a.port_num = 1;
    a.pkey_index = 1; /* the table has one entry */
    REFUSED(qa, &a, init);
    a.pkey_index = 0;
    a.qp_access_flags = 1 << 30; /* no such right */
    REFUSED(qa, &a, init);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
    CHECK(ibv_modify_qp(qa, &a, init) == 0 && state_of(qa) == IBV_QPS_INIT);
    /* INIT -> INIT takes the same attributes, all optional. */
    CHECK(ibv_modify_qp(qa, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS) == 0);
    /* INIT -> RTS skips a state. */
    struct ibv_qp_attr r = {0};
    r.qp_state = IBV_QPS_RTS;
    REFUSED(qa, &r, IBV_QP_STATE);

    /* INIT -> RTR (RC): AV, PATH_MTU, DEST_QPN, RQ_PSN, MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER. */
    r.qp_state = IBV_QPS_RTR;
    r.path_mtu = IBV_MTU_1024;
    r.dest_qp_num = qb->qp_num;
    r.max_dest_rd_atomic = 1;
    r.min_rnr_timer = 12;
    r.ah_attr = ah_to(&gid);
    int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    int required[] = {IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_DEST_QPN, IBV_QP_RQ_PSN,
                      IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER};
    for (unsigned i = 0; i < sizeof required / sizeof required[0]; i++)
        REFUSED(qa, &r, rtr & ~required[i]);
    REFUSED(qa, &r, rtr | IBV_QP_SQ_PSN); /* an RTS attribute */
    REFUSED(qa, &r, rtr | IBV_QP_TIMEOUT);
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0);
    r.path_mtu = (enum ibv_mtu)(pa.max_mtu + 1);
    REFUSED(qa, &r, rtr);
    r.path_mtu = (enum ibv_mtu)0;
    REFUSED(qa, &r, rtr);
    r.path_mtu = IBV_MTU_1024;
    r.max_dest_rd_atomic = (uint8_t)(da.max_qp_rd_atom + 1);
    REFUSED(qa, &r, rtr);
    r.max_dest_rd_atomic = 1;
    r.ah_attr.port_num = 2;
    REFUSED(qa, &r, rtr);
    r.ah_attr.port_num = 1;
    CHECK(ibv_modify_qp(qa, &r, rtr) == 0 && state_of(qa) == IBV_QPS_RTR);

    /* RTR -> RTS: SQ_PSN, TIMEOUT, RETRY_CNT, RNR_RETRY, MAX_QP_RD_ATOMIC. */
    struct ibv_qp_attr t = {0};
    t.qp_state = IBV_QPS_RTS;
    t.timeout = 14;
    t.retry_cnt = 7;
    t.rnr_retry = 7;
    t.max_rd_atomic = 1;
    int rts = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
              IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    int rts_required[] = {IBV_QP_SQ_PSN, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY,
                          IBV_QP_MAX_QP_RD_ATOMIC};
    for (unsigned i = 0; i < sizeof rts_required / sizeof rts_required[0]; i++)
        REFUSED(qa, &t, rts & ~rts_required[i]);
    REFUSED(qa, &t, rts | IBV_QP_DEST_QPN); /* an RTR attribute */
    t.max_rd_atomic = (uint8_t)(da.max_qp_init_rd_atom + 1);
    REFUSED(qa, &t, rts);
    t.max_rd_atomic = 1;
    t.retry_cnt = 8; /* three bits */
    REFUSED(qa, &t, rts);
    t.retry_cnt = 7;
    t.rnr_retry = 8;
    REFUSED(qa, &t, rts);
    t.rnr_retry = 7;
    t.timeout = 32; /* five bits */
    REFUSED(qa, &t, rts);
    t.timeout = 14;
    CHECK(ibv_modify_qp(qa, &t, rts) == 0 && state_of(qa) == IBV_QPS_RTS);
    /* RTS -> RTS: only the optional attributes; a path MTU is not one of them. */
    struct ibv_qp_attr u = {0};
    u.qp_state = IBV_QPS_RTS;
    u.path_mtu = IBV_MTU_512;
    REFUSED(qa, &u, IBV_QP_STATE | IBV_QP_PATH_MTU);
    u.min_rnr_timer = 3;
    CHECK(ibv_modify_qp(qa, &u, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER) == 0);
    /* Any state -> RESET and -> ERR. */
    u.qp_state = IBV_QPS_ERR;
    CHECK(ibv_modify_qp(qa, &u, IBV_QP_STATE) == 0 && state_of(qa) == IBV_QPS_ERR);
    u.qp_state = IBV_QPS_RTS;
    REFUSED(qa, &u, IBV_QP_STATE);
    u.qp_state = IBV_QPS_RESET;
    CHECK(ibv_modify_qp(qa, &u, IBV_QP_STATE) == 0 && state_of(qa) == IBV_QPS_RESET);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
}

/* A connected RC pair in one PD, a CQ, and a registered source buffer. */
struct pair {
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qa, *qb;
    char *src;
    struct ibv_mr *smr;
};

static void pair_open(struct ibv_context *ctx, struct pair *p, union ibv_gid *gid) {
    p->pd = ibv_alloc_pd(ctx);
    p->cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(p->pd && p->cq);
    create_rc_pair(p->pd, p->cq, &p->qa, &p->qb);
    connect_rc_pair(p->qa, p->qb, gid, RC_ACCESS_ALL);
    p->src = malloc(4096);
    CHECK(p->src);
    p->smr = ibv_reg_mr(p->pd, p->src, 4096, RC_ACCESS_ALL);
    CHECK(p->smr);
}

static void pair_close(struct pair *p) {
    CHECK(ibv_destroy_qp(p->qa) == 0 && ibv_destroy_qp(p->qb) == 0);
    CHECK(ibv_dereg_mr(p->smr) == 0 && ibv_destroy_cq(p->cq) == 0);
    CHECK(ibv_dealloc_pd(p->pd) == 0);
    free(p->src);
}

/* An RDMA op of `len` bytes between the pair's source and (addr, rkey); its status. */
static enum ibv_wc_status rdma(struct pair *p, enum ibv_wr_opcode op, void *addr, uint32_t len,
                               uint32_t rkey) {
    struct ibv_sge sge = {(uintptr_t)p->src, len, p->smr->lkey};
    struct ibv_send_wr wr = {0};
    wr.opcode = op;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = (uintptr_t)addr;
    wr.wr.rdma.rkey = rkey;
    post(p->qa, &wr);
    return poll1(p->cq).status;
}

static void family_rereg(struct ibv_context *ctx) {
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    for (int flags = 1; flags <= 7; flags++) {
        struct pair p1, p2;
        pair_open(ctx, &p1, &gid);
        pair_open(ctx, &p2, &gid);
        char *b1 = calloc(1, 4096), *b2 = calloc(1, 4096);
        CHECK(b1 && b2);
        int wr_only = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        struct ibv_mr *mr = ibv_reg_mr(p1.pd, b1, 4096, wr_only);
        CHECK(mr);
        int access = wr_only | IBV_ACCESS_REMOTE_READ;
        CHECK(ibv_rereg_mr(mr, flags, p2.pd, b2, 2048, access) == 0);
        struct pair *p = flags & IBV_REREG_MR_CHANGE_PD ? &p2 : &p1;
        char *at = flags & IBV_REREG_MR_CHANGE_TRANSLATION ? b2 : b1;
        uint32_t len = flags & IBV_REREG_MR_CHANGE_TRANSLATION ? 2048 : 4096;
        CHECK(mr->pd == p->pd && mr->addr == at && mr->length == len);
        memset(p->src, 'a' + flags, len);
        CHECK(rdma(p, IBV_WR_RDMA_WRITE, at, len, mr->rkey) == IBV_WC_SUCCESS);
        for (uint32_t i = 0; i < len; i++)
            CHECK(at[i] == 'a' + flags);
        /* A READ works exactly when the new rights have REMOTE_READ; then a WRITE past
         * the new length is refused (either failure ends p's QPs, so it comes last). */
        if (flags & IBV_REREG_MR_CHANGE_ACCESS) {
            CHECK(rdma(p, IBV_WR_RDMA_READ, at, 64, mr->rkey) == IBV_WC_SUCCESS);
            CHECK(rdma(p, IBV_WR_RDMA_WRITE, at + len - 8, 16, mr->rkey) ==
                  IBV_WC_REM_ACCESS_ERR);
        } else {
            CHECK(rdma(p, IBV_WR_RDMA_READ, at, 64, mr->rkey) == IBV_WC_REM_ACCESS_ERR);
        }
        /* Moved to another PD: the old PD's QPs no longer reach it. */
        if (flags & IBV_REREG_MR_CHANGE_PD)
            CHECK(rdma(&p1, IBV_WR_RDMA_WRITE, at, 8, mr->rkey) == IBV_WC_REM_ACCESS_ERR);
        CHECK(ibv_dereg_mr(mr) == 0);
        pair_close(&p1);
        pair_close(&p2);
        free(b1);
        free(b2);
    }
}

/* A thread that sends RDMA WRITEs of `len` bytes from `src` (region `lkey`) into `dst` until
 * one fails, which must be for the source region being gone. */
struct racer {
    struct pair p;
    char *src, *dst;
    size_t len;
    uint32_t lkey, rkey;
    volatile int ok;
    int prot;
};

static void *race_writer(void *arg) {
    struct racer *r = arg;
    for (;;) {
        struct ibv_sge sge = {(uintptr_t)r->src, (uint32_t)r->len, r->lkey};
        struct ibv_send_wr wr = {0};
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.wr.rdma.remote_addr = (uintptr_t)r->dst;
        wr.wr.rdma.rkey = r->rkey;
        post(r->p.qa, &wr);
        struct ibv_wc wc = poll1(r->p.cq);
        if (wc.status != IBV_WC_SUCCESS) {
            CHECK(wc.status == IBV_WC_LOC_PROT_ERR);
            r->prot++;
            return NULL;
        }
        r->ok++;
    }
}

/* ibv_dereg_mr of the region another thread's WRITEs copy from: once it returns, no access
 * through the region is under way or starts (its memory is unmapped at once, so an access
 * after would kill the program), and the writer's next request fails with LOC_PROT_ERR. */
static void family_dereg(struct ibv_context *ctx) {
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    const size_t len = 4 << 20;
    for (int round = 0; round < 16; round++) {
        struct racer r = {.len = len};
        pair_open(ctx, &r.p, &gid);
        r.src = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        r.dst = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(r.src != MAP_FAILED && r.dst != MAP_FAILED);
        memset(r.src, 'x', len);
        struct ibv_mr *smr = ibv_reg_mr(r.p.pd, r.src, len, IBV_ACCESS_LOCAL_WRITE);
        struct ibv_mr *dmr =
            ibv_reg_mr(r.p.pd, r.dst, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        CHECK(smr && dmr);
        r.lkey = smr->lkey;
        r.rkey = dmr->rkey;
        pthread_t writer;
        CHECK(pthread_create(&writer, NULL, race_writer, &r) == 0);
        /* Copies back to back: the deregistration comes in the middle of one. */
        while (r.ok < 1 + round % 3)
            sched_yield();
        usleep(37 * round % 200);
        CHECK(ibv_dereg_mr(smr) == 0);
        CHECK(munmap(r.src, len) == 0);
        CHECK(pthread_join(writer, NULL) == 0);
        CHECK(r.prot == 1 && r.ok >= 1);
        CHECK(r.dst[0] == 'x' && r.dst[len - 1] == 'x');
        CHECK(ibv_dereg_mr(dmr) == 0 && munmap(r.dst, len) == 0);
        pair_close(&r.p);
    }
}

static void family_odp(struct ibv_context *ctx) {
    struct ibv_device_attr_ex x;
    CHECK(ibv_query_device_ex(ctx, NULL, &x) == 0);
    CHECK((x.odp_caps.general_caps & (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT)) ==
          (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT));
    uint32_t rc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                  IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_SRQ_RECV;
    CHECK((x.odp_caps.per_transport_caps.rc_odp_caps & rc) == rc);
    /* Not promised: a peer process cannot update plain memory atomically. */
    CHECK(!(x.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_ATOMIC));
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    int odp = IBV_ACCESS_ON_DEMAND | RC_ACCESS_ALL;
    size_t pg = page_size(), big = 1 << 20;

    /* Explicit: a mapping never touched. */
    struct pair p;
    pair_open(ctx, &p, &gid);
    char *fresh = mmap(NULL, big, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(fresh != MAP_FAILED);
    struct ibv_mr *mr = ibv_reg_mr(p.pd, fresh, big, odp);
    CHECK(mr);
    memset(p.src, 'o', 4096);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, fresh + big / 2, 4096, mr->rkey) == IBV_WC_SUCCESS);
    for (int i = 0; i < 4096; i++)
        CHECK(fresh[big / 2 + i] == 'o');
    CHECK(rdma(&p, IBV_WR_RDMA_READ, fresh + 3 * pg, 4096, mr->rkey) == IBV_WC_SUCCESS);
    for (int i = 0; i < 4096; i++)
        CHECK(p.src[i] == 0);
    /* Prefetch: an ODP region yes, a plain one no, unmapped memory EFAULT. */
    struct ibv_sge pf = {(uintptr_t)fresh, (uint32_t)(64 * pg), mr->lkey};
    CHECK(ibv_advise_mr(p.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH,
                        &pf, 1) == 0);
    CHECK(ibv_advise_mr(p.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &pf, 1) == 0);
    struct ibv_sge plain = {(uintptr_t)p.src, 64, p.smr->lkey};
    CHECK(ibv_advise_mr(p.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &plain, 1) == EINVAL);
    CHECK(ibv_advise_mr(p.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &pf, 0) == EINVAL);

    /* Unmapped after registration: the error completion, and the prefetch fails. */
    CHECK(munmap(fresh + big - 16 * pg, 16 * pg) == 0);
    struct ibv_sge gone = {(uintptr_t)(fresh + big - 8 * pg), (uint32_t)pg, mr->lkey};
    CHECK(ibv_advise_mr(p.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &gone, 1) == EFAULT);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, fresh + big - 8 * pg, 64, mr->rkey) ==
          IBV_WC_REM_ACCESS_ERR);
    CHECK(ibv_dereg_mr(mr) == 0);
    pair_close(&p);
    munmap(fresh, big - 16 * pg);

    /* Implicit: one key over the whole address space. */
    pair_open(ctx, &p, &gid);
    struct ibv_mr *all = ibv_reg_mr(p.pd, NULL, SIZE_MAX, odp);
    CHECK(all);
    char *anywhere = malloc(8192);
    CHECK(anywhere);
    memset(anywhere, 0, 8192);
    memset(p.src, 'i', 4096);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, anywhere + 100, 4096, all->rkey) == IBV_WC_SUCCESS);
    CHECK(anywhere[100] == 'i' && anywhere[4195] == 'i' && anywhere[4196] == 0);
    /* An atomic on a word of it, from this process (works, though the caps do not promise
     * it: from another process it would be REM_INV_REQ_ERR). */
    uint64_t *word = (uint64_t *)(((uintptr_t)anywhere + 4200 + 7) & ~(uintptr_t)7);
    *word = 40;
    struct ibv_sge ret = {(uintptr_t)p.src, 8, p.smr->lkey};
    struct ibv_send_wr aw = {0};
    aw.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    aw.sg_list = &ret;
    aw.num_sge = 1;
    aw.wr.atomic.remote_addr = (uintptr_t)word;
    aw.wr.atomic.rkey = all->rkey;
    aw.wr.atomic.compare_add = 2;
    post(p.qa, &aw);
    CHECK(poll1(p.cq).status == IBV_WC_SUCCESS && *word == 42 && *(uint64_t *)p.src == 40);
    /* A SEND from unregistered memory through the implicit lkey, into a receive there too. */
    char *from = malloc(256), *to = calloc(1, 256);
    CHECK(from && to);
    memset(from, 's', 256);
    struct ibv_sge rs = {(uintptr_t)to, 256, all->lkey};
    struct ibv_recv_wr rw = {0}, *rbad = NULL;
    rw.sg_list = &rs;
    rw.num_sge = 1;
    CHECK(ibv_post_recv(p.qb, &rw, &rbad) == 0);
    struct ibv_sge ss = {(uintptr_t)from, 256, all->lkey};
    struct ibv_send_wr sw = {0};
    sw.opcode = IBV_WR_SEND;
    sw.sg_list = &ss;
    sw.num_sge = 1;
    post(p.qa, &sw);
    int seen = 0;
    for (int i = 0; i < 2; i++) {
        struct ibv_wc wc = poll1(p.cq);
        CHECK(wc.status == IBV_WC_SUCCESS);
        seen |= wc.opcode == IBV_WC_RECV ? 1 : 2;
    }
    CHECK(seen == 3 && memcmp(from, to, 256) == 0);
    /* An address nothing is mapped at: the error completion. */
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, (void *)(uintptr_t)0x1000, 64, all->rkey) ==
          IBV_WC_REM_ACCESS_ERR);
    CHECK(ibv_dereg_mr(all) == 0);
    pair_close(&p);
    free(anywhere);
    free(from);
    free(to);
}

/* A UD QP of `pd` on `cq` in RTS with Q_Key `qkey`. */
static struct ibv_qp *ud_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t qkey) {
    struct ibv_qp_init_attr ui = rc_init_attr(cq, 4, 1);
    ui.qp_type = IBV_QPT_UD;
    struct ibv_qp *ud = ibv_create_qp(pd, &ui);
    CHECK(ud);
    struct ibv_qp_attr ua = {0};
    ua.qp_state = IBV_QPS_INIT;
    ua.port_num = 1;
    ua.qkey = qkey;
    CHECK(ibv_modify_qp(ud, &ua, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0);
    ua.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(ud, &ua, IBV_QP_STATE) == 0);
    ua.qp_state = IBV_QPS_RTS;
    CHECK(ibv_modify_qp(ud, &ua, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0);
    return ud;
}

/* Two connected RC QPs made with ibv_create_qp_ex for the `ibv_wr_*` opcodes `send_ops`, both
 * completing on a new CQ of a new PD. */
struct ex_pair {
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qa, *qb;
};

static struct ex_pair rc_ex_pair(struct ibv_context *ctx, uint64_t send_ops) {
    struct ex_pair p;
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    p.pd = ibv_alloc_pd(ctx);
    p.cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(p.pd && p.cq);
    struct ibv_qp_init_attr_ex ie = {0};
    ie.send_cq = p.cq;
    ie.recv_cq = p.cq;
    ie.qp_type = IBV_QPT_RC;
    ie.cap.max_send_wr = 8;
    ie.cap.max_recv_wr = 8;
    ie.cap.max_send_sge = 1;
    ie.cap.max_recv_sge = 1;
    ie.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ie.pd = p.pd;
    ie.send_ops_flags = send_ops;
    p.qa = ibv_create_qp_ex(ctx, &ie);
    p.qb = ibv_create_qp_ex(ctx, &ie);
    CHECK(p.qa && p.qb);
    connect_rc_pair(p.qa, p.qb, &gid, RC_ACCESS_ALL);
    return p;
}

static void family_atomic_write(struct ibv_context *ctx) {
    struct ibv_device_attr_ex x;
    CHECK(ibv_query_device_ex(ctx, NULL, &x) == 0);
    CHECK(x.device_cap_flags_ex & (1ULL << 40));
    struct ex_pair ep = rc_ex_pair(ctx, IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_RDMA_WRITE);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct ibv_pd *pd = ep.pd;
    struct ibv_cq *cq = ep.cq;
    struct ibv_qp *qa = ep.qa, *qb = ep.qb;
    uint64_t *words = aligned_alloc(64, 64);
    CHECK(words);
    memset(words, 0, 64);
    struct ibv_mr *mr = ibv_reg_mr(pd, words, 64, RC_ACCESS_ALL);
    CHECK(mr);

    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(qa);
    uint64_t value = 0x1122334455667788ull;
    ibv_wr_start(qx);
    qx->wr_id = 7;
    qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_atomic_write(qx, mr->rkey, (uintptr_t)&words[1], &value);
    CHECK(ibv_wr_complete(qx) == 0);
    struct ibv_wc wc = poll1(cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_ATOMIC_WRITE && wc.wr_id == 7);
    CHECK(words[1] == value && words[0] == 0 && words[2] == 0);

    /* Through ibv_post_send: the SGE names the 8 bytes. */
    uint64_t second = 0x99aabbccddeeff00ull;
    struct ibv_sge sge = {(uintptr_t)&second, 8, 0};
    struct ibv_send_wr wr = {0}, *bad = NULL;
    wr.wr_id = 8;
    wr.opcode = IBV_WR_ATOMIC_WRITE;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = (uintptr_t)&words[2];
    wr.wr.rdma.rkey = mr->rkey;
    CHECK(ibv_post_send(qa, &wr, &bad) == 0);
    wc = poll1(cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_ATOMIC_WRITE && words[2] == second);
    /* Misaligned: refused at post. */
    wr.wr.rdma.remote_addr = (uintptr_t)&words[3] + 4;
    CHECK(ibv_post_send(qa, &wr, &bad) == EINVAL && bad == &wr);
    /* A region without REMOTE_WRITE: the responder's access error. */
    struct ibv_mr *ro = ibv_reg_mr(pd, words, 64, IBV_ACCESS_REMOTE_READ);
    CHECK(ro);
    wr.wr.rdma.remote_addr = (uintptr_t)&words[4];
    wr.wr.rdma.rkey = ro->rkey;
    CHECK(ibv_post_send(qa, &wr, &bad) == 0);
    wc = poll1(cq);
    CHECK(wc.status == IBV_WC_REM_ACCESS_ERR && words[4] == 0);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);

    /* UD has no ATOMIC WRITE. */
    struct ibv_qp *ud = ud_qp(pd, cq, 1);
    struct ibv_ah_attr aa = ah_to(&gid);
    struct ibv_ah *ah = ibv_create_ah(pd, &aa);
    CHECK(ah);
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = ud->qp_num;
    wr.wr.ud.remote_qkey = 1;
    CHECK(ibv_post_send(ud, &wr, &bad) == EINVAL);
    CHECK(ibv_destroy_qp(ud) == 0 && ibv_destroy_ah(ah) == 0);
    CHECK(ibv_dereg_mr(ro) == 0 && ibv_dereg_mr(mr) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
    free(words);
}

/* A bind of `mw` to `len` bytes at `addr` of `mr` with rkey `rkey`, posted on `qp` through
 * ibv_post_send; its completion. */
static struct ibv_wc bind_wr(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mw *mw,
                             uint32_t rkey, struct ibv_mr *mr, void *addr, uint64_t len,
                             unsigned int access) {
    struct ibv_send_wr wr = {0};
    wr.wr_id = 5;
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = (uintptr_t)addr;
    wr.bind_mw.bind_info.length = len;
    wr.bind_mw.bind_info.mw_access_flags = access;
    post(qp, &wr);
    return poll1(cq);
}

static void family_mw(struct ibv_context *ctx) {
    struct ibv_device_attr a;
    CHECK(ibv_query_device(ctx, &a) == 0);
    CHECK(a.device_cap_flags & IBV_DEVICE_MEM_WINDOW);
    CHECK(a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B);
    CHECK(a.max_mw > 0);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    const unsigned int rw = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

    /* Type 2 through ibv_post_send, bound by the responder QP over 1024..2048 of a region
     * with no remote rights of its own. */
    struct pair p;
    pair_open(ctx, &p, &gid);
    char *buf = calloc(1, 4096);
    CHECK(buf);
    struct ibv_mr *mr = ibv_reg_mr(p.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    CHECK(mr);
    errno = 0;
    CHECK(ibv_alloc_mw(p.pd, 3) == NULL && errno == EINVAL);
    struct ibv_mw *mw = ibv_alloc_mw(p.pd, IBV_MW_TYPE_2);
    CHECK(mw && mw->type == IBV_MW_TYPE_2 && mw->pd == p.pd && mw->context == ctx);
    struct ibv_mw_bind mb = {0};
    mb.bind_info.mr = mr;
    mb.bind_info.addr = (uintptr_t)buf;
    mb.bind_info.length = 64;
    mb.bind_info.mw_access_flags = rw;
    CHECK(ibv_bind_mw(p.qb, mw, &mb) == EINVAL); /* ibv_bind_mw is for type 1 */
    uint32_t rkey = ibv_inc_rkey(mw->rkey);
    struct ibv_wc wc = bind_wr(p.qb, p.cq, mw, rkey, mr, buf + 1024, 1024, rw);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 5);
    memset(p.src, 0x5a, 4096);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, buf + 1024, 1024, rkey) == IBV_WC_SUCCESS);
    CHECK(buf[1023] == 0 && buf[1024] == 0x5a && buf[2047] == 0x5a && buf[2048] == 0);
    CHECK(rdma(&p, IBV_WR_RDMA_READ, buf + 1024, 8, rkey) == IBV_WC_SUCCESS);
    CHECK(ibv_dereg_mr(mr) == EBUSY); /* a window is bound to it */

    /* WRITE, SEND with Invalidate, WRITE in one post: the window dies between them. */
    memset(buf + 1024, 0, 16);
    struct ibv_sge rs = {(uintptr_t)buf, 64, mr->lkey};
    struct ibv_recv_wr rwr = {0}, *rbad = NULL;
    rwr.wr_id = 40;
    rwr.sg_list = &rs;
    rwr.num_sge = 1;
    CHECK(ibv_post_recv(p.qb, &rwr, &rbad) == 0);
    struct ibv_sge ws = {(uintptr_t)p.src, 8, p.smr->lkey};
    struct ibv_send_wr w[3] = {{0}}, *bad = NULL;
    for (int i = 0; i < 3; i++) {
        w[i].wr_id = (uint64_t)i + 1;
        w[i].sg_list = &ws;
        w[i].num_sge = 1;
        w[i].send_flags = IBV_SEND_SIGNALED;
        w[i].next = i < 2 ? &w[i + 1] : NULL;
        w[i].opcode = IBV_WR_RDMA_WRITE;
        w[i].wr.rdma.rkey = rkey;
        w[i].wr.rdma.remote_addr = (uintptr_t)buf + 1024 + 8 * (uint64_t)i;
    }
    w[1].opcode = IBV_WR_SEND_WITH_INV;
    w[1].invalidate_rkey = rkey;
    CHECK(ibv_post_send(p.qa, w, &bad) == 0);
    int seen = 0;
    for (int i = 0; i < 4; i++) {
        wc = poll1(p.cq);
        if (wc.qp_num == p.qb->qp_num) {
            CHECK(wc.wr_id == 40 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV);
            CHECK((wc.wc_flags & IBV_WC_WITH_INV) && !(wc.wc_flags & IBV_WC_WITH_IMM));
            CHECK(wc.invalidated_rkey == rkey && wc.byte_len == 8);
        } else {
            CHECK(wc.wr_id == (uint64_t)seen + 1);
            CHECK(wc.status == (seen < 2 ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR));
            seen++;
        }
    }
    CHECK(seen == 3);
    CHECK(buf[1024] == 0x5a && buf[1032] == 0); /* byte 1024 by the first WRITE, 1032 never */
    CHECK(ibv_dereg_mr(mr) == 0); /* invalidated: nothing holds it */
    CHECK(ibv_dealloc_mw(mw) == 0);
    pair_close(&p);

    /* Type 1 through ibv_bind_mw, and the ibv_wr_* API. */
    pair_open(ctx, &p, &gid);
    mr = ibv_reg_mr(p.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    CHECK(mr);
    struct ibv_mw *m1 = ibv_alloc_mw(p.pd, IBV_MW_TYPE_1);
    CHECK(m1 && m1->type == IBV_MW_TYPE_1);
    uint32_t before = m1->rkey;
    mb.wr_id = 9;
    mb.send_flags = IBV_SEND_SIGNALED;
    mb.bind_info.mr = mr;
    mb.bind_info.addr = (uintptr_t)buf;
    mb.bind_info.length = 4096;
    mb.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
    CHECK(ibv_bind_mw(p.qa, m1, &mb) == 0); /* any QP of the PD: the requester here */
    CHECK(m1->rkey == ibv_inc_rkey(before));
    wc = poll1(p.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 9);
    memset(p.src, 0x11, 64);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, buf, 64, m1->rkey) == IBV_WC_SUCCESS && buf[63] == 0x11);

    struct ibv_mw *m2 = ibv_alloc_mw(p.pd, IBV_MW_TYPE_2);
    CHECK(m2);
    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(p.qb);
    struct ibv_mw_bind_info info = {mr, (uintptr_t)buf, 4096, rw};
    uint32_t k2 = ibv_inc_rkey(m2->rkey);
    ibv_wr_start(qx);
    qx->wr_id = 21;
    qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_bind_mw(qx, m2, k2, &info);
    CHECK(ibv_wr_complete(qx) == 0);
    wc = poll1(p.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 21);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, buf + 64, 64, k2) == IBV_WC_SUCCESS && buf[64] == 0x11);
    /* ibv_wr_send_inv from the requester frees it; a new bind with the next key reuses it. */
    rs.lkey = mr->lkey;
    CHECK(ibv_post_recv(p.qb, &rwr, &rbad) == 0);
    struct ibv_qp_ex *qxa = ibv_qp_to_qp_ex(p.qa);
    ibv_wr_start(qxa);
    qxa->wr_id = 22;
    qxa->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_send_inv(qxa, k2);
    ibv_wr_set_sge(qxa, p.smr->lkey, (uintptr_t)p.src, 4);
    CHECK(ibv_wr_complete(qxa) == 0);
    for (int i = 0; i < 2; i++) {
        wc = poll1(p.cq);
        CHECK(wc.status == IBV_WC_SUCCESS);
        if (wc.qp_num == p.qb->qp_num)
            CHECK((wc.wc_flags & IBV_WC_WITH_INV) && wc.invalidated_rkey == k2);
        else
            CHECK(wc.wr_id == 22 && wc.opcode == IBV_WC_SEND);
    }
    uint32_t k3 = ibv_inc_rkey(k2);
    ibv_wr_start(qx);
    qx->wr_id = 23;
    ibv_wr_bind_mw(qx, m2, k3, &info);
    ibv_wr_local_inv(qx, k3);
    CHECK(ibv_wr_complete(qx) == 0);
    wc = poll1(p.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW);
    wc = poll1(p.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_LOCAL_INV);
    CHECK(ibv_dealloc_mw(m1) == 0); /* bound: freeing unbinds it */
    CHECK(ibv_dereg_mr(mr) == 0);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, buf, 8, k3) == IBV_WC_REM_ACCESS_ERR);
    CHECK(ibv_dealloc_pd(p.pd) == EBUSY); /* a window lives in it */
    CHECK(ibv_dealloc_mw(m2) == 0);
    pair_close(&p);

    /* A bind by a QP of another PD: IBV_WC_MW_BIND_ERR, and the QP is in error. */
    struct pair q;
    pair_open(ctx, &p, &gid);
    pair_open(ctx, &q, &gid);
    mr = ibv_reg_mr(p.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    CHECK(mr);
    m2 = ibv_alloc_mw(p.pd, IBV_MW_TYPE_2);
    CHECK(m2);
    wc = bind_wr(q.qa, q.cq, m2, ibv_inc_rkey(m2->rkey), mr, buf, 64, rw);
    CHECK(wc.status == IBV_WC_MW_BIND_ERR && wc.opcode == IBV_WC_BIND_MW);
    CHECK(state_of(q.qa) == IBV_QPS_ERR);
    /* A region without MW_BIND: the same error. */
    struct ibv_mr *plain = ibv_reg_mr(p.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(plain);
    wc = bind_wr(p.qa, p.cq, m2, ibv_inc_rkey(m2->rkey), plain, buf, 64, rw);
    CHECK(wc.status == IBV_WC_MW_BIND_ERR);
    /* A window that is not ours: EINVAL at post, bad_wr set. */
    struct ibv_mw fake = *m2;
    struct ibv_send_wr fw = {0};
    fw.opcode = IBV_WR_BIND_MW;
    fw.bind_mw.mw = &fake;
    CHECK(ibv_post_send(p.qb, &fw, &bad) == EINVAL && bad == &fw);
    CHECK(ibv_dealloc_mw(m2) == 0);
    CHECK(ibv_dereg_mr(plain) == 0 && ibv_dereg_mr(mr) == 0);
    pair_close(&q);
    pair_close(&p);
    free(buf);
}

/* The next async event, within 5 s; its type and element are checked by the caller. */
static struct ibv_async_event next_event(struct ibv_context *ctx) {
    struct pollfd pfd = {ctx->async_fd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 5000) == 1);
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(ctx, &ev) == 0);
    ibv_ack_async_event(&ev);
    return ev;
}

static void no_more_events(struct ibv_context *ctx) {
    struct pollfd pfd = {ctx->async_fd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 50) == 0);
}

static void family_events(struct ibv_context *ctx) {
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct pair p;
    pair_open(ctx, &p, &gid);
    /* QP_REQ_ERR: the responder's QP allows no remote access. */
    struct ibv_qp_attr a = {0};
    a.qp_access_flags = 0;
    CHECK(ibv_modify_qp(p.qb, &a, IBV_QP_ACCESS_FLAGS) == 0);
    struct ibv_mr *mr = ibv_reg_mr(p.pd, p.src + 2048, 2048, RC_ACCESS_ALL);
    CHECK(mr);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, p.src + 2048, 64, mr->rkey) == IBV_WC_REM_INV_REQ_ERR);
    struct ibv_async_event ev = next_event(ctx);
    CHECK(ev.event_type == IBV_EVENT_QP_REQ_ERR && ev.element.qp == p.qb);
    no_more_events(ctx);
    CHECK(ibv_dereg_mr(mr) == 0);
    pair_close(&p);

    /* LAST_WQE_REACHED: a QP on an SRQ goes to ERR. */
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_srq_init_attr sa = {0};
    sa.attr.max_wr = 4;
    sa.attr.max_sge = 1;
    struct ibv_srq *srq = ibv_create_srq(pd, &sa);
    CHECK(pd && cq && srq);
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 4, 1);
    ia.srq = srq;
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    CHECK(qp);
    to_rts(qp, qp->qp_num, &gid, RC_ACCESS_ALL);
    struct ibv_qp_attr e = {0};
    e.qp_state = IBV_QPS_ERR;
    CHECK(ibv_modify_qp(qp, &e, IBV_QP_STATE) == 0);
    ev = next_event(ctx);
    CHECK(ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == qp);
    no_more_events(ctx);
    CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_srq(srq) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);

    /* CQ_ERR: more completions than the CQ holds, none polled. */
    pd = ibv_alloc_pd(ctx);
    struct ibv_cq *small = ibv_create_cq(ctx, 1, NULL, NULL, 0);
    CHECK(pd && small);
    ia = rc_init_attr(small, 64, 1);
    struct ibv_qp *qa = ibv_create_qp(pd, &ia), *qb = ibv_create_qp(pd, &ia);
    CHECK(qa && qb);
    connect_rc_pair(qa, qb, &gid, RC_ACCESS_ALL);
    char *buf = malloc(64);
    CHECK(buf);
    struct ibv_mr *bm = ibv_reg_mr(pd, buf, 64, RC_ACCESS_ALL);
    CHECK(bm);
    struct ibv_sge sge = {(uintptr_t)buf, 8, bm->lkey};
    for (int i = 0; i < small->cqe + 2; i++) {
        struct ibv_send_wr wr = {0}, *bad = NULL;
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr.rdma.remote_addr = (uintptr_t)buf + 8;
        wr.wr.rdma.rkey = bm->rkey;
        if (ibv_post_send(qa, &wr, &bad) != 0)
            break; /* the QP may already have failed: the event is what counts */
    }
    ev = next_event(ctx);
    CHECK(ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == small);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0 && ibv_dereg_mr(bm) == 0);
    CHECK(ibv_destroy_cq(small) == 0 && ibv_dealloc_pd(pd) == 0);
    free(buf);
}

static void family_dm(struct ibv_context *ctx) {
    struct ibv_device_attr_ex x;
    CHECK(ibv_query_device_ex(ctx, NULL, &x) == 0);
    CHECK(x.max_dm_size >= 4096);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct pair p;
    pair_open(ctx, &p, &gid);
    struct ibv_alloc_dm_attr da = {4096, 3, 0};
    struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
    CHECK(dm);
    char pat[256];
    for (int i = 0; i < 256; i++)
        pat[i] = (char)(i * 7 + 1);
    CHECK(ibv_memcpy_to_dm(dm, 512, pat, sizeof pat) == 0);
    CHECK(ibv_memcpy_to_dm(dm, 4000, pat, 200) == EINVAL); /* past the end */
    errno = 0;
    CHECK(ibv_reg_dm_mr(p.pd, dm, 0, 4096, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ibv_reg_dm_mr(p.pd, dm, 2048, 4096, IBV_ACCESS_ZERO_BASED) == NULL && errno == EINVAL);
    struct ibv_mr *mr = ibv_reg_dm_mr(p.pd, dm, 0, 4096, IBV_ACCESS_ZERO_BASED | RC_ACCESS_ALL);
    CHECK(mr);
    /* Zero-based: the remote address is the offset in the region. */
    CHECK(rdma(&p, IBV_WR_RDMA_READ, (void *)(uintptr_t)512, 256, mr->rkey) == IBV_WC_SUCCESS);
    CHECK(memcmp(p.src, pat, 256) == 0);
    memset(p.src, 'd', 128);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, (void *)(uintptr_t)1024, 128, mr->rkey) == IBV_WC_SUCCESS);
    char back[128];
    CHECK(ibv_memcpy_from_dm(back, dm, 1024, 128) == 0);
    for (int i = 0; i < 128; i++)
        CHECK(back[i] == 'd');
    /* An atomic on device memory. */
    uint64_t forty = 40;
    CHECK(ibv_memcpy_to_dm(dm, 2048, &forty, 8) == 0);
    struct ibv_sge ret = {(uintptr_t)p.src, 8, p.smr->lkey};
    struct ibv_send_wr aw = {0};
    aw.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    aw.sg_list = &ret;
    aw.num_sge = 1;
    aw.wr.atomic.remote_addr = 2048;
    aw.wr.atomic.rkey = mr->rkey;
    aw.wr.atomic.compare_add = 2;
    post(p.qa, &aw);
    CHECK(poll1(p.cq).status == IBV_WC_SUCCESS && *(uint64_t *)p.src == 40);
    uint64_t now = 0;
    CHECK(ibv_memcpy_from_dm(&now, dm, 2048, 8) == 0 && now == 42);
    CHECK(ibv_free_dm(dm) == EBUSY);
    CHECK(ibv_dereg_mr(mr) == 0 && ibv_free_dm(dm) == 0);
    /* More than the device has. */
    struct ibv_alloc_dm_attr huge = {x.max_dm_size + 1, 0, 0};
    CHECK(ibv_alloc_dm(ctx, &huge) == NULL);
    struct ibv_alloc_dm_attr zero = {0, 0, 0};
    errno = 0;
    CHECK(ibv_alloc_dm(ctx, &zero) == NULL && errno == EINVAL);
    pair_close(&p);
}

static int allocs;
static void *count_alloc(struct ibv_pd *pd, void *pd_context, size_t size, size_t align,
                         uint64_t type) {
    (void)pd, (void)pd_context, (void)size, (void)align, (void)type;
    allocs++;
    return IBV_ALLOCATOR_USE_DEFAULT;
}
static void count_free(struct ibv_pd *pd, void *pd_context, void *ptr, uint64_t type) {
    (void)pd, (void)pd_context, (void)ptr, (void)type;
}

static void family_domain(struct ibv_context *ctx) {
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct ibv_td_init_attr ta = {0};
    struct ibv_td *td = ibv_alloc_td(ctx, &ta);
    CHECK(td);
    ta.comp_mask = 1;
    errno = 0;
    CHECK(ibv_alloc_td(ctx, &ta) == NULL && errno == EINVAL);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd);
    struct ibv_parent_domain_init_attr pa = {0};
    pa.pd = pd;
    pa.td = td;
    pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
    pa.alloc = count_alloc;
    pa.free = count_free;
    pa.pd_context = &allocs;
    struct ibv_pd *parent = ibv_alloc_parent_domain(ctx, &pa);
    CHECK(parent);
    /* Not over another parent domain, not without a PD. */
    struct ibv_parent_domain_init_attr nested = pa;
    nested.pd = parent;
    errno = 0;
    CHECK(ibv_alloc_parent_domain(ctx, &nested) == NULL && errno == EINVAL);
    nested.pd = NULL;
    CHECK(ibv_alloc_parent_domain(ctx, &nested) == NULL);
    CHECK(ibv_dealloc_td(td) == EBUSY && ibv_dealloc_pd(pd) == EBUSY);

    struct ibv_cq_init_attr_ex ca = {0};
    ca.cqe = 16;
    ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
    ca.parent_domain = parent;
    struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
    CHECK(cqx);
    ca.parent_domain = pd; /* a plain PD is not a parent domain */
    errno = 0;
    CHECK(ibv_create_cq_ex(ctx, &ca) == NULL && errno == EINVAL);
    struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 8, 1);
    struct ibv_qp *qa = ibv_create_qp(parent, &ia), *qb = ibv_create_qp(pd, &ia);
    CHECK(qa && qb);
    connect_rc_pair(qa, qb, &gid, RC_ACCESS_ALL);
    char *src = malloc(4096), *dst = calloc(1, 4096);
    CHECK(src && dst);
    memset(src, 'p', 4096);
    /* The source registered in the parent domain, the target in its PD: one protection domain. */
    struct ibv_mr *smr = ibv_reg_mr(parent, src, 4096, RC_ACCESS_ALL);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, 4096, RC_ACCESS_ALL);
    CHECK(smr && dmr && smr->pd == parent);
    struct ibv_sge sge = {(uintptr_t)src, 4096, smr->lkey};
    struct ibv_send_wr wr = {0};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = (uintptr_t)dst;
    wr.wr.rdma.rkey = dmr->rkey;
    post(qa, &wr);
    CHECK(poll1(cq).status == IBV_WC_SUCCESS && memcmp(src, dst, 4096) == 0);
    CHECK(ibv_dealloc_pd(parent) == EBUSY);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0);
    CHECK(ibv_destroy_cq(cq) == 0);
    CHECK(ibv_dealloc_pd(parent) == 0);
    CHECK(ibv_dealloc_td(td) == 0 && ibv_dealloc_pd(pd) == 0);
    CHECK(allocs == 0);
    free(src);
    free(dst);
}

/* UD multicast: the caps, delivery to the attached QPs only, detach, and the errors. */
static void family_mcast(struct ibv_context *ctx) {
    struct ibv_device_attr a;
    CHECK(ibv_query_device(ctx, &a) == 0);
    CHECK(a.max_mcast_grp > 0 && a.max_mcast_qp_attach > 0 &&
          a.max_total_mcast_qp_attach >= a.max_mcast_qp_attach);
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0);
    uint16_t mlid = pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? 0xc0c1 : 0;
    union ibv_gid mgid = {.raw = {0xff, 0x12, 0x40, 0x1b, [14] = 0xc0, [15] = 0xc1}};
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq[3];
    struct ibv_qp *qp[3];
    char *buf = calloc(3, 256);
    CHECK(pd && buf);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 3 * 256, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr);
    for (int i = 0; i < 3; i++) {
        cq[i] = ibv_create_cq(ctx, 8, NULL, NULL, 0);
        CHECK(cq[i]);
        qp[i] = ud_qp(pd, cq[i], 0x11);
        struct ibv_sge s = {(uintptr_t)buf + 256 * (uint64_t)i, 256, mr->lkey};
        struct ibv_recv_wr r = {0}, *rb = NULL;
        r.wr_id = 100 + (uint64_t)i;
        r.sg_list = &s;
        r.num_sge = 1;
        CHECK(ibv_post_recv(qp[i], &r, &rb) == 0);
    }
    union ibv_gid plain;
    CHECK(ibv_query_gid(ctx, 1, 0, &plain) == 0);
    CHECK(ibv_attach_mcast(qp[0], &plain, mlid) == EINVAL); /* not a multicast GID */
    CHECK(ibv_detach_mcast(qp[0], &mgid, mlid) == EINVAL);  /* not attached */
    CHECK(ibv_attach_mcast(qp[0], &mgid, mlid) == 0);
    CHECK(ibv_attach_mcast(qp[0], &mgid, mlid) == 0); /* again: as the kernel, no error */
    CHECK(ibv_attach_mcast(qp[1], &mgid, mlid) == 0);
    CHECK(ibv_destroy_qp(qp[1]) == EBUSY); /* attached: detach first */

    struct ibv_ah_attr aa = {0};
    aa.port_num = 1;
    aa.dlid = mlid;
    aa.is_global = 1;
    aa.grh.dgid = mgid;
    aa.grh.hop_limit = 1;
    struct ibv_ah *ah = ibv_create_ah(pd, &aa);
    CHECK(ah);
    strcpy(buf + 2 * 256 + 128, "multicast");
    struct ibv_sge ss = {(uintptr_t)buf + 2 * 256 + 128, 10, mr->lkey};
    struct ibv_send_wr w = {0};
    w.wr_id = 7;
    w.opcode = IBV_WR_SEND;
    w.sg_list = &ss;
    w.num_sge = 1;
    w.wr.ud.ah = ah;
    w.wr.ud.remote_qpn = 0xffffff;
    w.wr.ud.remote_qkey = 0x11;
    post(qp[2], &w);
    struct ibv_wc wc = poll1(cq[2]);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 7);
    for (int i = 0; i < 2; i++) {
        wc = poll1(cq[i]);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 100 + (uint64_t)i);
        CHECK(wc.opcode == IBV_WC_RECV && wc.src_qp == qp[2]->qp_num && wc.byte_len == 50);
        CHECK(wc.wc_flags & IBV_WC_GRH);
        CHECK(!memcmp(buf + 256 * i + 24, mgid.raw, 16)); /* the GRH's destination: the group */
        CHECK(!strcmp(buf + 256 * i + 40, "multicast"));
    }
    usleep(20000);
    CHECK(ibv_poll_cq(cq[2], 1, &wc) == 0); /* qp[2] is not a member: no copy */
    CHECK(ibv_detach_mcast(qp[0], &mgid, mlid) == 0 && ibv_detach_mcast(qp[1], &mgid, mlid) == 0);
    CHECK(ibv_detach_mcast(qp[1], &mgid, mlid) == EINVAL);

    /* Only UD QPs join. */
    struct ibv_qp_init_attr ri = rc_init_attr(cq[0], 4, 1);
    struct ibv_qp *rc = ibv_create_qp(pd, &ri);
    CHECK(rc && ibv_attach_mcast(rc, &mgid, mlid) == EINVAL);
    CHECK(ibv_destroy_qp(rc) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(ibv_destroy_qp(qp[i]) == 0 && ibv_destroy_cq(cq[i]) == 0);
    CHECK(ibv_destroy_ah(ah) == 0 && ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0);
    free(buf);
}

static void family_srq_ah(struct ibv_context *ctx) {
    struct ibv_device_attr a;
    CHECK(ibv_query_device(ctx, &a) == 0);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd);
    struct ibv_srq_init_attr sa = {0};
#define SRQ_REFUSED(wr, sge, limit)                                                            \
    do {                                                                                       \
        sa.attr.max_wr = (wr);                                                                 \
        sa.attr.max_sge = (sge);                                                               \
        sa.attr.srq_limit = (limit);                                                           \
        errno = 0;                                                                             \
        CHECK(ibv_create_srq(pd, &sa) == NULL && errno == EINVAL);                             \
    } while (0)
    SRQ_REFUSED((uint32_t)a.max_srq_wr + 1, 1, 0);
    SRQ_REFUSED(16, (uint32_t)a.max_srq_sge + 1, 0);
    SRQ_REFUSED(0, 1, 0);
    SRQ_REFUSED(16, 1, 17); /* a limit above the size */
#undef SRQ_REFUSED
    sa.attr.max_wr = 16;
    sa.attr.max_sge = 2;
    sa.attr.srq_limit = 0;
    struct ibv_srq *srq = ibv_create_srq(pd, &sa);
    CHECK(srq && sa.attr.max_wr >= 16 && sa.attr.max_sge >= 2);
    struct ibv_srq_attr q;
    CHECK(ibv_query_srq(srq, &q) == 0 && q.max_wr >= 16 && q.max_sge >= 2 && q.srq_limit == 0);
    struct ibv_srq_attr m = {0};
    m.srq_limit = q.max_wr + 1;
    CHECK(ibv_modify_srq(srq, &m, IBV_SRQ_LIMIT) == EINVAL);
    m.srq_limit = 4;
    CHECK(ibv_modify_srq(srq, &m, IBV_SRQ_LIMIT) == 0);
    CHECK(ibv_query_srq(srq, &q) == 0 && q.srq_limit == 4);
    CHECK(ibv_destroy_srq(srq) == 0);

    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct ibv_ah_attr ah = ah_to(&gid);
    ah.port_num = 2;
    errno = 0;
    CHECK(ibv_create_ah(pd, &ah) == NULL && errno == EINVAL);
    ah.port_num = 1;
    ah.grh.sgid_index = (uint8_t)pa.gid_tbl_len;
    errno = 0;
    CHECK(ibv_create_ah(pd, &ah) == NULL && errno == EINVAL);
    ah.grh.sgid_index = 0;
    if (pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
        ah.is_global = 0;
        errno = 0;
        CHECK(ibv_create_ah(pd, &ah) == NULL && errno == EINVAL);
        ah.is_global = 1;
    }
    struct ibv_ah *h = ibv_create_ah(pd, &ah);
    CHECK(h && ibv_destroy_ah(h) == 0);

    /* ibv_query_qp gives back the attributes set. */
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(cq);
    struct ibv_qp *qa, *qb;
    create_rc_pair(pd, cq, &qa, &qb);
    connect_rc_pair(qa, qb, &gid, IBV_ACCESS_REMOTE_READ);
    struct ibv_qp_attr qattr;
    struct ibv_qp_init_attr qinit;
    CHECK(ibv_query_qp(qa, &qattr, IBV_QP_STATE | IBV_QP_DEST_QPN | IBV_QP_ACCESS_FLAGS |
                                       IBV_QP_PATH_MTU | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                       IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC |
                                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER | IBV_QP_CAP,
                       &qinit) == 0);
    CHECK(qattr.qp_state == IBV_QPS_RTS && qattr.dest_qp_num == qb->qp_num);
    CHECK(qattr.qp_access_flags == IBV_ACCESS_REMOTE_READ && qattr.path_mtu == IBV_MTU_1024);
    CHECK(qattr.timeout == 14 && qattr.retry_cnt == 7 && qattr.rnr_retry == 7);
    CHECK(qattr.max_rd_atomic == 1 && qattr.max_dest_rd_atomic == 1 && qattr.min_rnr_timer == 12);
    CHECK(qinit.send_cq == cq && qinit.recv_cq == cq && qinit.qp_type == IBV_QPT_RC);
    CHECK(qinit.cap.max_send_wr >= 16 && qattr.cap.max_send_wr == qinit.cap.max_send_wr);
    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
}

static void family_fork(struct ibv_context *ctx) {
    CHECK(ibv_fork_init() == 0 && ibv_is_fork_initialized() == IBV_FORK_UNNEEDED);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    struct pair p;
    pair_open(ctx, &p, &gid);
    size_t len = 4096;
    char *target = malloc(len);
    CHECK(target);
    struct ibv_mr *tmr = ibv_reg_mr(p.pd, target, len, RC_ACCESS_ALL);
    CHECK(tmr);
    memset(target, 'P', len);

    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        /* The child's copy: its writes are its own. */
        memset(target, 'C', len);
        _exit(target[0] == 'C' && target[len - 1] == 'C' ? 0 : 3);
    }
    int st = 0;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    for (size_t i = 0; i < len; i++)
        CHECK(target[i] == 'P');

    /* The parent's registrations still work: an RDMA WRITE lands in the parent. */
    memset(p.src, 'W', len);
    CHECK(rdma(&p, IBV_WR_RDMA_WRITE, target, (uint32_t)len, tmr->rkey) == IBV_WC_SUCCESS);
    for (size_t i = 0; i < len; i++)
        CHECK(target[i] == 'W');
    CHECK(ibv_dereg_mr(tmr) == 0);
    pair_close(&p);
    free(target);
}

/* An XRC initiator or target through INIT and RTR (and RTS for the initiator), with the
 * kernel's masks for each. */
static void xrc_connect(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid) {
    int ini = qp->qp_type == IBV_QPT_XRC_SEND;
    to_init(qp, IBV_ACCESS_REMOTE_WRITE);
    if (ini) { /* an initiator receives nothing: no RNR timer, no responder resources */
        CHECK(init_to_rtr(qp, dest, gid, IBV_QP_MIN_RNR_TIMER) == EINVAL);
        CHECK(init_to_rtr(qp, dest, gid, 0) == 0);
        rtr_to_rts(qp);
    } else {
        CHECK(init_to_rtr(qp, dest, gid, IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0);
    }
}

static struct ibv_srq *xrc_srq(struct ibv_context *ctx, struct ibv_pd *pd,
                               struct ibv_xrcd *xrcd, struct ibv_cq *cq) {
    struct ibv_srq_init_attr_ex s = {0};
    s.attr.max_wr = 8;
    s.attr.max_sge = 1;
    s.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD |
                  IBV_SRQ_INIT_ATTR_CQ;
    s.srq_type = IBV_SRQT_XRC;
    s.pd = pd;
    s.xrcd = xrcd;
    s.cq = cq;
    return ibv_create_srq_ex(ctx, &s);
}

static void family_xrc(struct ibv_context *ctx) {
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0);
    CHECK(da.device_cap_flags & IBV_DEVICE_XRC);
    char path[] = "/tmp/softverbs-xrcd-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    struct ibv_xrcd_init_attr xa = {0};
    xa.comp_mask = IBV_XRCD_INIT_ATTR_FD;
    xa.fd = fd;
    errno = 0;
    CHECK(!ibv_open_xrcd(ctx, &xa) && errno == EINVAL); /* no OFLAGS in the mask */
    xa.comp_mask |= IBV_XRCD_INIT_ATTR_OFLAGS;
    xa.oflags = 0;
    errno = 0;
    CHECK(!ibv_open_xrcd(ctx, &xa) && errno == EINVAL); /* none yet, and no O_CREAT */
    xa.oflags = O_CREAT;
    struct ibv_xrcd *xrcd = ibv_open_xrcd(ctx, &xa);
    CHECK(xrcd && xrcd->context == ctx);
    xa.oflags = O_CREAT | O_EXCL;
    errno = 0;
    CHECK(!ibv_open_xrcd(ctx, &xa) && errno == EINVAL);
    xa.fd = -1; /* a domain of this process alone */
    xa.oflags = O_CREAT;
    struct ibv_xrcd *other = ibv_open_xrcd(ctx, &xa);
    CHECK(other);

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *scq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_cq *rcq[2] = {ibv_create_cq(ctx, 16, NULL, NULL, 0),
                             ibv_create_cq(ctx, 16, NULL, NULL, 0)};
    CHECK(pd && scq && rcq[0] && rcq[1]);
    struct ibv_srq *srq[2] = {xrc_srq(ctx, pd, xrcd, rcq[0]), xrc_srq(ctx, pd, xrcd, rcq[1])};
    struct ibv_srq *foreign = xrc_srq(ctx, pd, other, rcq[0]);
    CHECK(srq[0] && srq[1] && foreign);
    uint32_t num[2], fnum;
    CHECK(ibv_get_srq_num(srq[0], &num[0]) == 0 && ibv_get_srq_num(srq[1], &num[1]) == 0);
    CHECK(ibv_get_srq_num(foreign, &fnum) == 0);
    CHECK(num[0] != num[1] && fnum != num[0] && fnum != num[1]);
    char *buf = calloc(1, 4096);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE |
                                                       IBV_ACCESS_REMOTE_WRITE);
    CHECK(buf && mr);
    for (int i = 0; i < 2; i++) {
        struct ibv_sge s = {(uintptr_t)buf + 256 * (uint64_t)i, 256, mr->lkey};
        struct ibv_recv_wr r = {0}, *rb = NULL;
        r.wr_id = 10 + (uint64_t)i;
        r.sg_list = &s;
        r.num_sge = 1;
        CHECK(ibv_post_srq_recv(srq[i], &r, &rb) == 0);
    }

    struct ibv_qp_init_attr_ex ia = {0};
    ia.qp_type = IBV_QPT_XRC_SEND;
    ia.send_cq = scq;
    ia.cap.max_send_wr = 8;
    ia.cap.max_send_sge = 1;
    ia.cap.max_inline_data = 64;
    ia.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ia.pd = pd;
    ia.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
    struct ibv_qp *ini = ibv_create_qp_ex(ctx, &ia);
    CHECK(ini && ini->qp_type == IBV_QPT_XRC_SEND && ia.cap.max_recv_wr == 0);
    struct ibv_qp_init_attr_ex ta = {0};
    ta.qp_type = IBV_QPT_XRC_RECV;
    ta.comp_mask = IBV_QP_INIT_ATTR_XRCD;
    ta.xrcd = xrcd;
    struct ibv_qp *tgt = ibv_create_qp_ex(ctx, &ta);
    CHECK(tgt && tgt->qp_type == IBV_QPT_XRC_RECV);
    struct ibv_qp_init_attr plain = {0};
    plain.qp_type = IBV_QPT_XRC_RECV;
    plain.send_cq = plain.recv_cq = scq;
    errno = 0;
    CHECK(!ibv_create_qp(pd, &plain) && errno == EINVAL); /* a target needs its domain */
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    xrc_connect(tgt, ini->qp_num, &gid);
    xrc_connect(ini, tgt->qp_num, &gid);

    struct ibv_qp_open_attr oa = {0};
    oa.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
    oa.qp_num = tgt->qp_num;
    oa.xrcd = xrcd;
    oa.qp_type = IBV_QPT_XRC_RECV;
    struct ibv_qp *opened = ibv_open_qp(ctx, &oa);
    CHECK(opened && opened->qp_num == tgt->qp_num);
    struct ibv_qp_attr qa;
    struct ibv_qp_init_attr qi;
    CHECK(ibv_query_qp(opened, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RTR);
    CHECK(ibv_destroy_qp(opened) == 0); /* the handle; the target stays */
    oa.xrcd = other;
    errno = 0;
    CHECK(!ibv_open_qp(ctx, &oa) && errno == EINVAL); /* not in that domain */

    struct ibv_recv_wr r = {0}, *rb = NULL;
    CHECK(ibv_post_recv(ini, &r, &rb) == EINVAL);

    /* SRQ 1 through ibv_post_send, SRQ 0 through the ibv_wr_* API. */
    struct ibv_sge in = {(uintptr_t)"to srq one", 10, 0};
    struct ibv_send_wr w = {0};
    w.wr_id = 1;
    w.sg_list = &in;
    w.num_sge = 1;
    w.opcode = IBV_WR_SEND;
    w.send_flags = IBV_SEND_INLINE;
    w.qp_type.xrc.remote_srqn = num[1];
    post(ini, &w);
    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(ini);
    ibv_wr_start(qx);
    qx->wr_id = 2;
    qx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_wr_send(qx);
    ibv_wr_set_xrc_srqn(qx, num[0]);
    ibv_wr_set_inline_data(qx, "to srq zero", 11);
    CHECK(ibv_wr_complete(qx) == 0);
    for (int i = 0; i < 2; i++)
        CHECK(poll1(scq).status == IBV_WC_SUCCESS);
    for (int i = 0; i < 2; i++) {
        struct ibv_wc wc = poll1(rcq[i]);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV);
        CHECK(wc.wr_id == 10 + (uint64_t)i && wc.qp_num == tgt->qp_num &&
              wc.src_qp == ini->qp_num);
    }
    CHECK(!memcmp(buf, "to srq zero", 11) && !memcmp(buf + 256, "to srq one", 10));

    /* An RDMA WRITE with a key of the SRQ's PD. */
    w.wr_id = 3;
    w.opcode = IBV_WR_RDMA_WRITE;
    w.wr.rdma.remote_addr = (uintptr_t)buf + 1024;
    w.wr.rdma.rkey = mr->rkey;
    w.qp_type.xrc.remote_srqn = num[0];
    post(ini, &w);
    CHECK(poll1(scq).status == IBV_WC_SUCCESS);
    CHECK(!memcmp(buf + 1024, "to srq one", 10));

    /* The busy rules, while the domain's objects live. */
    CHECK(ibv_close_xrcd(xrcd) == EBUSY);
    CHECK(ibv_destroy_cq(rcq[1]) == EBUSY);

    /* An SRQ of another domain: an invalid request, and the target goes to ERR. */
    w.wr_id = 4;
    w.opcode = IBV_WR_SEND;
    w.qp_type.xrc.remote_srqn = fnum;
    post(ini, &w);
    CHECK(poll1(scq).status == IBV_WC_REM_INV_REQ_ERR);
    CHECK(ibv_query_qp(tgt, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_ERR);

    CHECK(ibv_destroy_qp(ini) == 0 && ibv_destroy_qp(tgt) == 0);
    for (int i = 0; i < 2; i++)
        CHECK(ibv_destroy_srq(srq[i]) == 0);
    CHECK(ibv_destroy_srq(foreign) == 0);
    CHECK(ibv_close_xrcd(xrcd) == 0 && ibv_close_xrcd(other) == 0);
    CHECK(ibv_dereg_mr(mr) == 0);
    for (int i = 0; i < 2; i++)
        CHECK(ibv_destroy_cq(rcq[i]) == 0);
    CHECK(ibv_destroy_cq(scq) == 0 && ibv_dealloc_pd(pd) == 0);
    free(buf);
    close(fd);
    unlink(path);
}

/* The child of `import`: argv = import_child FD PD_HANDLE MR_HANDLE PARENT_QPN. */
static int import_child(char **argv) {
    int fd = atoi(argv[2]);
    uint32_t pd_handle = (uint32_t)strtoul(argv[3], NULL, 0);
    uint32_t mr_handle = (uint32_t)strtoul(argv[4], NULL, 0);
    uint32_t parent_qpn = (uint32_t)strtoul(argv[5], NULL, 0);
    struct ibv_context *ctx = ibv_import_device(fd);
    CHECK(ctx && ctx->cmd_fd >= 0);
    errno = 0;
    CHECK(!ibv_import_pd(ctx, pd_handle + 1000) && errno != 0);
    struct ibv_pd *pd = ibv_import_pd(ctx, pd_handle);
    CHECK(pd && pd->handle == pd_handle && pd->context == ctx);
    errno = 0;
    CHECK(!ibv_import_mr(pd, mr_handle + 0x100000) && errno != 0);
    struct ibv_mr *mr = ibv_import_mr(pd, mr_handle);
    CHECK(mr && mr->lkey == mr_handle && mr->length == 4096 && mr->pd == pd);
    char local[64];
    errno = 0;
    CHECK(!ibv_reg_mr(pd, local, sizeof local, IBV_ACCESS_LOCAL_WRITE) && errno == EOPNOTSUPP);
    struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
    CHECK(cq);
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 4, 1);
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    CHECK(qp);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    to_rts(qp, parent_qpn, &gid, 0);
    printf("%u\n", qp->qp_num);
    fflush(stdout);
    char go[8];
    CHECK(fgets(go, sizeof go, stdin));
    /* The region's bytes are the parent's: its address is the parent's too. */
    struct ibv_sge sge = {(uintptr_t)mr->addr, 64, mr->lkey};
    struct ibv_send_wr w = {0};
    w.wr_id = 1;
    w.sg_list = &sge;
    w.num_sge = 1;
    w.opcode = IBV_WR_SEND;
    post(qp, &w);
    CHECK(poll1(cq).status == IBV_WC_SUCCESS);
    CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0);
    ibv_unimport_mr(mr);
    ibv_unimport_pd(pd);
    CHECK(ibv_close_device(ctx) == 0);
    return 0;
}

static void family_import(struct ibv_context *ctx) {
    struct stat st;
    CHECK(ctx->cmd_fd >= 0 && fstat(ctx->cmd_fd, &st) == 0);
    errno = 0;
    CHECK(!ibv_import_device(-1) && errno != 0);
    errno = 0;
    CHECK(!ibv_import_pd(ctx, 1) && errno != 0); /* not an imported context */
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
    char *buf = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *inbox = calloc(1, 4096);
    CHECK(pd && cq && buf != MAP_FAILED && inbox);
    for (int i = 0; i < 64; i++)
        buf[i] = (char)('a' + i % 26);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *in = ibv_reg_mr(pd, inbox, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr && in);
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 4, 1);
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    CHECK(qp);
    to_init(qp, 0);
    struct ibv_sge s = {(uintptr_t)inbox, 4096, in->lkey};
    struct ibv_recv_wr r = {0}, *rb = NULL;
    r.wr_id = 7;
    r.sg_list = &s;
    r.num_sge = 1;
    CHECK(ibv_post_recv(qp, &r, &rb) == 0);

    int fd = dup(ctx->cmd_fd); /* inherited by the child: no O_CLOEXEC */
    int to_child[2], from_child[2];
    CHECK(fd >= 0 && pipe(to_child) == 0 && pipe(from_child) == 0);
    char a_fd[16], a_pd[16], a_mr[16], a_qpn[16];
    snprintf(a_fd, sizeof a_fd, "%d", fd);
    snprintf(a_pd, sizeof a_pd, "%u", pd->handle);
    snprintf(a_mr, sizeof a_mr, "%u", mr->handle);
    snprintf(a_qpn, sizeof a_qpn, "%u", qp->qp_num);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        dup2(to_child[0], 0);
        dup2(from_child[1], 1);
        char *args[] = {"conformance", "import_child", a_fd, a_pd, a_mr, a_qpn, NULL};
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(fd);
    close(to_child[0]);
    close(from_child[1]);
    FILE *out = fdopen(from_child[0], "r");
    unsigned child_qpn = 0;
    CHECK(out && fscanf(out, "%u", &child_qpn) == 1);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0);
    CHECK(init_to_rtr(qp, child_qpn, &gid, IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) ==
          0);
    CHECK(write(to_child[1], "go\n", 3) == 3);
    struct ibv_wc wc = poll1(cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 7 && wc.byte_len == 64);
    CHECK(!memcmp(inbox, buf, 64));
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    fclose(out);
    close(to_child[1]);
    CHECK(ibv_destroy_qp(qp) == 0 && ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(in) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
    munmap(buf, 4096);
    free(inbox);
}

/* rdma-core 45's additions for RDMA FLUSH (see the family's description). */
struct qp_ex_45 {
    struct ibv_qp_ex base;
    void (*wr_flush)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, size_t len,
                     uint8_t type, uint8_t level);
};
enum { QP_EX_WITH_FLUSH = 1 << 11, ACCESS_FLUSH_GLOBAL = 1 << 8, WC_FLUSH = 8 };
enum { FLUSH_GLOBAL = 1, FLUSH_PERSISTENT = 2, FLUSH_RANGE = 0, FLUSH_MR = 1 };

static void family_flush(struct ibv_context *ctx) {
    struct ibv_device_attr_ex x;
    CHECK(ibv_query_device_ex(ctx, NULL, &x) == 0);
    CHECK(x.device_cap_flags_ex & (1ULL << 38));
    struct ex_pair ep = rc_ex_pair(ctx, QP_EX_WITH_FLUSH | IBV_QP_EX_WITH_RDMA_WRITE);
    struct ibv_pd *pd = ep.pd;
    struct ibv_cq *cq = ep.cq;
    struct ibv_qp *qa = ep.qa, *qb = ep.qb;
    char *dst = calloc(1, 4096), *src = calloc(1, 64), *plain = calloc(1, 64);
    CHECK(dst && src && plain);
    memset(src, 'F', 64);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, 4096, RC_ACCESS_ALL | ACCESS_FLUSH_GLOBAL);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, 64, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *pmr = ibv_reg_mr(pd, plain, 64, RC_ACCESS_ALL);
    CHECK(dmr && smr && pmr);

    struct qp_ex_45 *qx = (struct qp_ex_45 *)ibv_qp_to_qp_ex(qa);
    CHECK(qx->wr_flush);
    ibv_wr_start(&qx->base);
    qx->base.wr_id = 1;
    qx->base.wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_rdma_write(&qx->base, dmr->rkey, (uintptr_t)dst + 100);
    ibv_wr_set_sge(&qx->base, smr->lkey, (uintptr_t)src, 64);
    qx->base.wr_id = 2;
    qx->wr_flush(&qx->base, dmr->rkey, (uintptr_t)dst + 100, 64, FLUSH_GLOBAL, FLUSH_RANGE);
    qx->base.wr_id = 3;
    qx->wr_flush(&qx->base, dmr->rkey, (uintptr_t)dst, 0, FLUSH_GLOBAL, FLUSH_MR);
    CHECK(ibv_wr_complete(&qx->base) == 0);
    struct ibv_wc wc = poll1(cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 && wc.opcode == IBV_WC_RDMA_WRITE);
    for (uint64_t id = 2; id <= 3; id++) {
        wc = poll1(cq);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == id && (int)wc.opcode == WC_FLUSH);
    }
    CHECK(!memcmp(dst + 100, src, 64));

    /* Persistent placement (no persistent memory) and a type that is none. */
    ibv_wr_start(&qx->base);
    qx->wr_flush(&qx->base, dmr->rkey, (uintptr_t)dst, 64, FLUSH_PERSISTENT, FLUSH_RANGE);
    CHECK(ibv_wr_complete(&qx->base) == EOPNOTSUPP);
    ibv_wr_start(&qx->base);
    qx->wr_flush(&qx->base, dmr->rkey, (uintptr_t)dst, 64, 0, FLUSH_RANGE);
    CHECK(ibv_wr_complete(&qx->base) == EINVAL);

    /* A region without FLUSH_GLOBAL: the responder refuses it. */
    ibv_wr_start(&qx->base);
    qx->base.wr_id = 4;
    qx->wr_flush(&qx->base, pmr->rkey, (uintptr_t)plain, 64, FLUSH_GLOBAL, FLUSH_RANGE);
    CHECK(ibv_wr_complete(&qx->base) == 0);
    wc = poll1(cq);
    CHECK(wc.status == IBV_WC_REM_ACCESS_ERR && wc.wr_id == 4);

    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_dereg_mr(dmr) == 0 && ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(pmr) == 0);
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0);
    free(dst);
    free(src);
    free(plain);
}

int main(int argc, char **argv) {
    if (argc == 6 && !strcmp(argv[1], "import_child"))
        return import_child(argv);
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
    else if (!strcmp(argv[1], "query"))
        family_query(ctx);
    else if (!strcmp(argv[1], "qp"))
        family_qp(ctx);
    else if (!strcmp(argv[1], "modify"))
        family_modify(ctx);
    else if (!strcmp(argv[1], "fork"))
        family_fork(ctx);
    else if (!strcmp(argv[1], "rereg"))
        family_rereg(ctx);
    else if (!strcmp(argv[1], "dereg"))
        family_dereg(ctx);
    else if (!strcmp(argv[1], "odp"))
        family_odp(ctx);
    else if (!strcmp(argv[1], "awrite"))
        family_atomic_write(ctx);
    else if (!strcmp(argv[1], "events"))
        family_events(ctx);
    else if (!strcmp(argv[1], "dm"))
        family_dm(ctx);
    else if (!strcmp(argv[1], "domain"))
        family_domain(ctx);
    else if (!strcmp(argv[1], "srq_ah"))
        family_srq_ah(ctx);
    else if (!strcmp(argv[1], "mw"))
        family_mw(ctx);
    else if (!strcmp(argv[1], "mcast"))
        family_mcast(ctx);
    else if (!strcmp(argv[1], "xrc"))
        family_xrc(ctx);
    else if (!strcmp(argv[1], "import"))
        family_import(ctx);
    else if (!strcmp(argv[1], "flush"))
        family_flush(ctx);
    else
        CHECK(!"a known family");
    CHECK(ibv_close_device(ctx) == 0);
    printf("ok\n");
    return 0;
}
