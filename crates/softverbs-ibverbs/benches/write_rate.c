/* 64-byte RDMA WRITE message rate through the drop-in, with the loop `softverbs perf` runs
 * through the Rust API (unsignaled WRITEs, one in 100 signaled, at most 128 outstanding, 16
 * completions a poll): what the C ABI costs beside the same work, without perftest's own
 * per-post bookkeeping. PT=1 adds that bookkeeping as ib_write_bw's run_iter_bw does it (a
 * TSC reading stored per post, the local and remote address cycling through the buffer with
 * a 64-bit division each, the cq_mod remainders). Two processes (fork), the target on CPU 1.
 *
 *   gcc -O2 -o write_rate write_rate.c -libverbs
 *   softverbs run -- ./write_rate 20000000          # or PT=1 softverbs run -- ...
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sched.h>
#include <time.h>
#include <sys/wait.h>
#include <x86intrin.h>
struct ep { uint32_t qpn; uint16_t lid; union ibv_gid gid; uint64_t addr; uint32_t rkey; };
#define INC(size, cls) (((size) > (cls)) ? ((size)) : (cls))
int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 10000000;
    int pt = getenv("PT") ? atoi(getenv("PT")) : 0;
    int p2c[2], c2p[2]; pipe(p2c); pipe(c2p);
    pid_t child = fork();
    int server = child == 0;
    cpu_set_t s; CPU_ZERO(&s); CPU_SET(server ? 1 : 0, &s); sched_setaffinity(0, sizeof s, &s);
    struct ibv_device **l = ibv_get_device_list(NULL);
    struct ibv_context *ctx = ibv_open_device(l[0]);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    char *buf = aligned_alloc(4096, 65536); memset(buf, 0, 65536);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 65536, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    struct ibv_cq *scq = ibv_create_cq(ctx, 128, NULL, NULL, 0), *rcq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 128, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    struct ibv_port_attr pa; ibv_query_port(ctx, 1, &pa);
    struct ep me = { qp->qp_num, pa.lid }, peer; ibv_query_gid(ctx, 1, 0, &me.gid);
    me.addr = (uintptr_t)buf; me.rkey = mr->rkey;
    write(server ? c2p[1] : p2c[1], &me, sizeof me); read(server ? p2c[0] : c2p[0], &peer, sizeof peer);
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE|IBV_QP_PKEY_INDEX|IBV_QP_PORT|IBV_QP_ACCESS_FLAGS)) { perror("init"); return 1; }
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = peer.qpn; a.rq_psn = 0; a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
    a.ah_attr.dlid = peer.lid; a.ah_attr.port_num = 1; a.ah_attr.is_global = 1; a.ah_attr.grh.dgid = peer.gid; a.ah_attr.grh.hop_limit = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE|IBV_QP_AV|IBV_QP_PATH_MTU|IBV_QP_DEST_QPN|IBV_QP_RQ_PSN|IBV_QP_MAX_DEST_RD_ATOMIC|IBV_QP_MIN_RNR_TIMER)) { perror("rtr"); return 1; }
    a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.sq_psn = 0; a.max_rd_atomic = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE|IBV_QP_TIMEOUT|IBV_QP_RETRY_CNT|IBV_QP_RNR_RETRY|IBV_QP_SQ_PSN|IBV_QP_MAX_QP_RD_ATOMIC)) { perror("rts"); return 1; }
    char c = 0; write(server ? c2p[1] : p2c[1], &c, 1); read(server ? p2c[0] : c2p[0], &c, 1);
    if (server) { read(p2c[0], &c, 1); return 0; }
    struct ibv_sge ss = { (uintptr_t)buf, 64, mr->lkey };
    struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE }, *bsw;
    swr.wr.rdma.remote_addr = peer.addr; swr.wr.rdma.rkey = peer.rkey;
    volatile int vsize = 64, vcls = 64, vcyc = 4096; int size = vsize, cls = vcls, cyc = vcyc; uint64_t cq_mod = 100;
    uint64_t *tposted = pt ? malloc(8 * iters) : NULL;
    struct ibv_wc wc[16];
    uint64_t scnt = 0, ccnt = 0;
    struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    while (ccnt < (uint64_t)iters) {
        while (scnt < (uint64_t)iters && scnt + 1 <= 128 + ccnt) {
            if (pt) { if (scnt % cq_mod == 0) swr.send_flags &= ~IBV_SEND_SIGNALED; tposted[scnt] = __rdtsc(); }
            else swr.send_flags = (scnt % 100 == 99 || scnt == (uint64_t)iters - 1) ? IBV_SEND_SIGNALED : 0;
            if (ibv_post_send(qp, &swr, &bsw)) { fprintf(stderr, "post_send\n"); return 1; }
            if (pt) {
                ss.addr += INC(size, cls); if (((scnt + 1) % (cyc / INC(size, cls))) == 0) ss.addr = (uintptr_t)buf;
                swr.wr.rdma.remote_addr += INC(size, cls); if (((scnt + 1) % (cyc / INC(size, cls))) == 0) swr.wr.rdma.remote_addr = peer.addr;
            }
            scnt++;
            if (pt && (scnt % cq_mod == cq_mod - 1 || scnt == (uint64_t)iters - 1)) swr.send_flags |= IBV_SEND_SIGNALED;
        }
        int ne = ibv_poll_cq(scq, 16, wc);
        for (int i = 0; i < ne; i++) { if (wc[i].status) { fprintf(stderr, "status %d\n", wc[i].status); return 1; } ccnt += 100; }
        if (ccnt > scnt) ccnt = scnt;
        if (ne > 0 && scnt == (uint64_t)iters) break;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("%s %.2f M msg/s\n", pt ? "with perftest bookkeeping" : "plain loop", iters / sec / 1e6);
    write(p2c[1], &c, 1); wait(NULL);
    return 0;
}
