/* Built by tests/capi.rs against Debian's <infiniband/verbs.h> and the system libibverbs,
 * then run with the softverbs drop-in found first. Prints "ok" and exits 0 on success. */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "%s:%d: CHECK(%s) failed (errno %d)\n", __FILE__, __LINE__, #c, errno); exit(1); } } while (0)

static struct ibv_cq *cq;

static void wait_wc(enum ibv_wc_opcode op, uint64_t wr_id) {
    struct ibv_wc wc;
    int n;
    for (long spins = 0;; spins++) {
        n = ibv_poll_cq(cq, 1, &wc);
        CHECK(n >= 0);
        if (n == 1) break;
        CHECK(spins < 100000000L);
    }
    if (wc.status != IBV_WC_SUCCESS || wc.opcode != op || wc.wr_id != wr_id) {
        fprintf(stderr, "wc: status %s opcode %d wr_id %llu (want op %d id %llu)\n",
                ibv_wc_status_str(wc.status), wc.opcode, (unsigned long long)wc.wr_id, op,
                (unsigned long long)wr_id);
        exit(1);
    }
}

static void to_rts(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                    IBV_QP_ACCESS_FLAGS) == 0);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = *gid;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                    IBV_QP_MIN_RNR_TIMER) == 0);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                    IBV_QP_MAX_QP_RD_ATOMIC) == 0);
}

static void post(struct ibv_qp *qp, struct ibv_send_wr *wr) {
    struct ibv_send_wr *bad = NULL;
    wr->send_flags |= IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(qp, wr, &bad) == 0);
}

int main(void) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1);
    CHECK(strcmp(ibv_get_device_name(list[0]), "softverbs0") == 0);
    struct ibv_context *ctx = ibv_open_device(list[0]);
    CHECK(ctx);
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0 && da.phys_port_cnt == 1 && da.max_qp > 0);
    struct ibv_device_attr_ex dax;
    CHECK(ibv_query_device_ex(ctx, NULL, &dax) == 0 && dax.orig_attr.max_qp == da.max_qp);
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0);
    CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET);
    CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[15] == 1);
    uint16_t pkey;
    CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == 0xffff);

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd);
    size_t len = 4096;
    char *a = aligned_alloc(4096, len), *b = aligned_alloc(4096, len);
    CHECK(a && b);
    memset(a, 0, len);
    memset(b, 0, len);

    /* Bad access flags: remote write without local write. */
    errno = 0;
    CHECK(ibv_reg_mr(pd, a, len, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL);
    int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
              IBV_ACCESS_REMOTE_ATOMIC;
    struct ibv_mr *ma = ibv_reg_mr(pd, a, len, acc), *mb = ibv_reg_mr(pd, b, len, acc);
    CHECK(ma && mb);

    cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(cq);
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 16;
    ia.cap.max_recv_wr = 16;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    struct ibv_qp *qa = ibv_create_qp(pd, &ia), *qb = ibv_create_qp(pd, &ia);
    CHECK(qa && qb);

    /* Wrong transition: RESET -> RTR. */
    struct ibv_qp_attr bad = {0};
    bad.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(qa, &bad, IBV_QP_STATE) == EINVAL);

    to_rts(qa, qb->qp_num, &gid);
    to_rts(qb, qa->qp_num, &gid);
    struct ibv_qp_attr qattr;
    struct ibv_qp_init_attr qinit;
    CHECK(ibv_query_qp(qa, &qattr, IBV_QP_STATE, &qinit) == 0 && qattr.qp_state == IBV_QPS_RTS);

    /* SEND (and SEND_WITH_IMM) into a posted receive. */
    struct ibv_sge rsge = {(uintptr_t)b, 64, mb->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 100, .sg_list = &rsge, .num_sge = 1}, *rbad;
    CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0);
    strcpy(a, "hello over softverbs");
    struct ibv_sge sge = {(uintptr_t)a, 21, ma->lkey};
    struct ibv_send_wr wr = {0};
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.imm_data = htonl(0x1234);
    post(qa, &wr);
    /* The send and the receive completion share the CQ, in either order. */
    int got_send = 0, got_recv = 0;
    while (!(got_send && got_recv)) {
        struct ibv_wc wc;
        int k = ibv_poll_cq(cq, 1, &wc);
        CHECK(k >= 0);
        if (k == 0) continue;
        CHECK(wc.status == IBV_WC_SUCCESS);
        if (wc.wr_id == 1) {
            CHECK(wc.opcode == IBV_WC_SEND);
            got_send = 1;
        } else {
            CHECK(wc.wr_id == 100 && wc.opcode == IBV_WC_RECV && wc.byte_len == 21);
            CHECK((wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == 0x1234);
            CHECK(wc.qp_num == qb->qp_num);
            got_recv = 1;
        }
    }
    CHECK(strcmp(b, "hello over softverbs") == 0);

    /* RDMA WRITE. */
    memset(&wr, 0, sizeof wr);
    strcpy(a, "written");
    wr.wr_id = 2;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    sge.length = 8;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 128);
    wr.wr.rdma.rkey = mb->rkey;
    post(qa, &wr);
    wait_wc(IBV_WC_RDMA_WRITE, 2);
    CHECK(strcmp(b + 128, "written") == 0);

    /* RDMA READ. */
    strcpy(b + 256, "read me");
    wr.wr_id = 3;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 256);
    sge.addr = (uintptr_t)(a + 256);
    post(qa, &wr);
    wait_wc(IBV_WC_RDMA_READ, 3);
    CHECK(strcmp(a + 256, "read me") == 0);

    /* Atomics. */
    uint64_t *target = (uint64_t *)(b + 512), *old = (uint64_t *)(a + 512);
    *target = 5;
    memset(&wr, 0, sizeof wr);
    sge.addr = (uintptr_t)old;
    sge.length = 8;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr_id = 4;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.remote_addr = (uintptr_t)target;
    wr.wr.atomic.rkey = mb->rkey;
    wr.wr.atomic.compare_add = 10;
    post(qa, &wr);
    wait_wc(IBV_WC_FETCH_ADD, 4);
    CHECK(*old == 5 && *target == 15);
    wr.wr_id = 5;
    wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
    wr.wr.atomic.compare_add = 15;
    wr.wr.atomic.swap = 99;
    post(qa, &wr);
    wait_wc(IBV_WC_COMP_SWAP, 5);
    CHECK(*old == 15 && *target == 99);

    /* A bad rkey fails the work request, not the process. */
    wr.wr_id = 6;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = (uintptr_t)b;
    wr.wr.rdma.rkey = mb->rkey + 12345;
    post(qa, &wr);
    struct ibv_wc wc;
    while (ibv_poll_cq(cq, 1, &wc) == 0) {}
    CHECK(wc.wr_id == 6 && wc.status == IBV_WC_REM_ACCESS_ERR);

    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_destroy_cq(cq) == 0);
    CHECK(ibv_dereg_mr(ma) == 0 && ibv_dereg_mr(mb) == 0);
    CHECK(ibv_dealloc_pd(pd) == 0);
    CHECK(ibv_close_device(ctx) == 0);
    ibv_free_device_list(list);
    printf("ok\n");
    return 0;
}
