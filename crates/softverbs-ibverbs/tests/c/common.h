/* Helpers shared by the C test programs in this directory (capi.c, poll_cq_ex.c,
 * noncontig.c): the CHECK macro, opening the first device, a loopback pair of RC QPs and
 * their connection, posting and polling. Only <infiniband/verbs.h> is needed, so capi.c
 * (built against the system's headers alone) can include it too. */
#ifndef SOFTVERBS_TESTS_C_COMMON_H
#define SOFTVERBS_TESTS_C_COMMON_H

#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "%s:%d: CHECK(%s) failed (errno %d)\n", __FILE__, __LINE__, #c, errno); exit(1); } } while (0)

/* Every remote access an RC QP can allow. */
#define RC_ACCESS_ALL                                                                          \
    (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |             \
     IBV_ACCESS_REMOTE_ATOMIC)

/* The first device, opened; the list is freed. */
static inline struct ibv_context *open_first_device(void) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1);
    struct ibv_context *ctx = ibv_open_device(list[0]);
    CHECK(ctx);
    ibv_free_device_list(list);
    return ctx;
}

/* An RC QP's creation attributes: both queues on `cq`, `wr` work requests of `sge` SGEs
 * each way. */
static inline struct ibv_qp_init_attr rc_init_attr(struct ibv_cq *cq, uint32_t wr, uint32_t sge) {
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = wr;
    ia.cap.max_recv_wr = wr;
    ia.cap.max_send_sge = sge;
    ia.cap.max_recv_sge = sge;
    return ia;
}

/* Two RC QPs whose sends and receives both complete on `cq`, 16 work requests of one SGE
 * each way. */
static inline void create_rc_pair(struct ibv_pd *pd, struct ibv_cq *cq, struct ibv_qp **qa,
                                  struct ibv_qp **qb) {
    struct ibv_qp_init_attr ia = rc_init_attr(cq, 16, 1);
    *qa = ibv_create_qp(pd, &ia);
    *qb = ibv_create_qp(pd, &ia);
    CHECK(*qa && *qb);
}

/* An address vector to `gid` on port 1, with a GRH (which a RoCE port needs). */
static inline struct ibv_ah_attr ah_to(union ibv_gid *gid) {
    struct ibv_ah_attr a = {0};
    a.is_global = 1;
    a.grh.dgid = *gid;
    a.grh.hop_limit = 1;
    a.port_num = 1;
    return a;
}

/* RESET → INIT on port 1, allowing `access`. */
static inline void to_init(struct ibv_qp *qp, int access) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = access;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                    IBV_QP_ACCESS_FLAGS) == 0);
}

/* INIT → RTR from QP `dest` on port 1 of `gid`; `extra`: the responder's attributes
 * (IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER) that the QP type takes. Returns what
 * ibv_modify_qp returned. */
static inline int init_to_rtr(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid, int extra) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dest;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr = ah_to(gid);
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | extra);
}

/* RTR → RTS with RC's requester attributes. */
static inline void rtr_to_rts(struct ibv_qp *qp) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                    IBV_QP_MAX_QP_RD_ATOMIC) == 0);
}

/* RESET → INIT → RTR → RTS, connected to QP `dest` on port 1 of `gid`, allowing `access`. */
static inline void to_rts(struct ibv_qp *qp, uint32_t dest, union ibv_gid *gid, int access) {
    to_init(qp, access);
    CHECK(init_to_rtr(qp, dest, gid, IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0);
    rtr_to_rts(qp);
}

/* Both QPs to RTS, each connected to the other. */
static inline void connect_rc_pair(struct ibv_qp *qa, struct ibv_qp *qb, union ibv_gid *gid,
                                   int access) {
    to_rts(qa, qb->qp_num, gid, access);
    to_rts(qb, qa->qp_num, gid, access);
}

/* Posts `wr`, signaled. */
static inline void post(struct ibv_qp *qp, struct ibv_send_wr *wr) {
    struct ibv_send_wr *bad = NULL;
    wr->send_flags |= IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(qp, wr, &bad) == 0);
}

static inline double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline uint64_t realtime_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* The next completion of `cq` (10 s at most). */
static inline struct ibv_wc poll1(struct ibv_cq *cq) {
    struct ibv_wc wc;
    double end = mono_now() + 10;
    for (;;) {
        int n = ibv_poll_cq(cq, 1, &wc);
        CHECK(n >= 0);
        if (n == 1)
            return wc;
        CHECK(mono_now() < end);
    }
}

#endif
