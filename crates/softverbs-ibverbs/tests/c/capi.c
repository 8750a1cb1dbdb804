/* Built by tests/capi.rs against Debian's <infiniband/verbs.h> and the system libibverbs,
 * then run with the softverbs drop-in found first. Prints "ok" and exits 0 on success. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/time.h>

#include "common.h"

static struct ibv_cq *cq;

static volatile sig_atomic_t alarmed;
static void on_alarm(int sig) {
    (void)sig;
    alarmed = 1;
}

static void wait_wc(enum ibv_wc_opcode op, uint64_t wr_id) {
    struct ibv_wc wc = poll1(cq);
    if (wc.status != IBV_WC_SUCCESS || wc.opcode != op || wc.wr_id != wr_id) {
        fprintf(stderr, "wc: status %s opcode %d wr_id %llu (want op %d id %llu)\n",
                ibv_wc_status_str(wc.status), wc.opcode, (unsigned long long)wc.wr_id, op,
                (unsigned long long)wr_id);
        exit(1);
    }
}

/* A CQ made with ibv_create_cq_ex, polled with ibv_start_poll/ibv_next_poll/ibv_end_poll
 * after RC traffic, and its creation errors. */
static void cq_ex_section(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_mr *ma,
                          struct ibv_mr *mb, union ibv_gid *gid) {
    struct ibv_cq_init_attr_ex ca = {0};
    ca.cqe = 32;
    ca.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM |
                  IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SL | IBV_WC_EX_WITH_SLID |
                  IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
                  IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
    /* Unknown comp_mask bits: EINVAL; completion fields the device cannot give: EOPNOTSUPP. */
    ca.comp_mask = 1u << 7;
    errno = 0;
    CHECK(ibv_create_cq_ex(ctx, &ca) == NULL && errno == EINVAL);
    ca.comp_mask = 0;
    ca.wc_flags |= IBV_WC_EX_WITH_FLOW_TAG;
    errno = 0;
    CHECK(ibv_create_cq_ex(ctx, &ca) == NULL && errno == EOPNOTSUPP);
    ca.wc_flags &= ~(uint64_t)IBV_WC_EX_WITH_FLOW_TAG;
    struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
    CHECK(ch);
    ca.channel = ch;
    ca.cq_context = &ca;
    ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
    ca.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
    struct ibv_cq_ex *cx = ibv_create_cq_ex(ctx, &ca);
    CHECK(cx);
    cq = ibv_cq_ex_to_cq(cx);
    CHECK(cq->cqe >= 32);

    /* Empty: ENOENT, and end_poll must not be called. */
    struct ibv_poll_cq_attr pa = {0};
    CHECK(ibv_start_poll(cx, &pa) == ENOENT);

    struct ibv_qp *qa, *qb;
    create_rc_pair(pd, cq, &qa, &qb);
    connect_rc_pair(qa, qb, gid, RC_ACCESS_ALL);

    char *a = ma->addr, *b = mb->addr;
    struct ibv_sge rsge = {(uintptr_t)b, 64, mb->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 200, .sg_list = &rsge, .num_sge = 1}, *rbad;
    CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0);
    strcpy(a, "extended cq");
    struct ibv_sge sge = {(uintptr_t)a, 12, ma->lkey};
    struct ibv_send_wr wr = {0};
    wr.wr_id = 11;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.imm_data = htonl(0xabcd);
    post(qa, &wr);
    memset(&wr, 0, sizeof wr);
    wr.wr_id = 12;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 1024);
    wr.wr.rdma.rkey = mb->rkey;
    post(qa, &wr);

    uint64_t wall_before = realtime_ns();
    /* Wait until all three completions are queued, then take them in one polling section. */
    int seen = 0, got_send = 0, got_recv = 0, got_write = 0;
    uint64_t first_ts = 0;
    for (long spins = 0; seen < 3; spins++) {
        CHECK(spins < 100000000L);
        int r = ibv_start_poll(cx, &pa);
        if (r == ENOENT) continue;
        CHECK(r == 0);
        do {
            CHECK(cx->status == IBV_WC_SUCCESS);
            uint64_t ts = ibv_wc_read_completion_ts(cx);
            if (!first_ts) first_ts = ts;
            uint64_t wall = ibv_wc_read_completion_wallclock_ns(cx);
            /* Within a minute of now (and never in the future by more than a second). */
            CHECK(wall + 60000000000ull > wall_before && wall < wall_before + 1000000000ull);
            CHECK(ibv_wc_read_vendor_err(cx) == 0);
            switch (cx->wr_id) {
            case 11:
                CHECK(ibv_wc_read_opcode(cx) == IBV_WC_SEND);
                CHECK(ibv_wc_read_qp_num(cx) == qa->qp_num);
                got_send = 1;
                break;
            case 12:
                CHECK(ibv_wc_read_opcode(cx) == IBV_WC_RDMA_WRITE);
                got_write = 1;
                break;
            case 200:
                CHECK(ibv_wc_read_opcode(cx) == IBV_WC_RECV);
                CHECK(ibv_wc_read_byte_len(cx) == 12);
                CHECK(ibv_wc_read_wc_flags(cx) & IBV_WC_WITH_IMM);
                CHECK(ntohl(ibv_wc_read_imm_data(cx)) == 0xabcd);
                CHECK(ibv_wc_read_qp_num(cx) == qb->qp_num);
                CHECK(ibv_wc_read_src_qp(cx) == qa->qp_num);
                (void)ibv_wc_read_slid(cx);
                (void)ibv_wc_read_sl(cx);
                got_recv = 1;
                break;
            default:
                CHECK(!"unexpected wr_id");
            }
            seen++;
        } while ((r = ibv_next_poll(cx)) == 0);
        CHECK(r == ENOENT);
        ibv_end_poll(cx);
    }
    CHECK(got_send && got_recv && got_write && first_ts != 0);
    CHECK(strcmp(b, "extended cq") == 0 && strcmp(b + 1024, "extended cq") == 0);

    /* Completion events on the extended CQ's channel; O_NONBLOCK on channel->fd is honoured. */
    int fl = fcntl(ch->fd, F_GETFL);
    CHECK(fl >= 0 && fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0);
    struct ibv_cq *ev_cq;
    void *ev_ctx;
    errno = 0;
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN);
    CHECK(ibv_req_notify_cq(cq, 0) == 0);
    wr.wr_id = 14;
    post(qa, &wr);
    struct pollfd pfd = {.fd = ch->fd, .events = POLLIN};
    CHECK(poll(&pfd, 1, 10000) == 1);
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq && ev_ctx == &ca);
    /* The event taken, the descriptor is not readable: a program that waits for it in an
     * event loop (Open MPI's openib) would call ibv_get_cq_event for nothing and block. */
    pfd.revents = 0;
    CHECK(poll(&pfd, 1, 0) == 0);
    ibv_ack_cq_events(ev_cq, 1);
    /* Blocking again: the call waits for the event. */
    CHECK(fcntl(ch->fd, F_SETFL, fl) == 0);
    /* A caught signal (a handler without SA_RESTART) ends the wait with EINTR, as rdma-core's
     * read(2) of the channel does: qperf ends its tests so. */
    struct sigaction sa = {0}, old_sa;
    sa.sa_handler = on_alarm;
    CHECK(sigaction(SIGALRM, &sa, &old_sa) == 0);
    struct itimerval it = {.it_value = {.tv_usec = 20000}};
    CHECK(setitimer(ITIMER_REAL, &it, NULL) == 0);
    errno = 0;
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EINTR && alarmed);
    CHECK(sigaction(SIGALRM, &old_sa, NULL) == 0);
    CHECK(ibv_start_poll(cx, &pa) == 0 && cx->wr_id == 14 && cx->status == IBV_WC_SUCCESS);
    CHECK(ibv_next_poll(cx) == ENOENT);
    ibv_end_poll(cx);
    CHECK(ibv_req_notify_cq(cq, 0) == 0);
    wr.wr_id = 15;
    post(qa, &wr);
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq);
    ibv_ack_cq_events(ev_cq, 1);
    CHECK(cq->comp_events_completed == 2);
    struct ibv_wc wc;
    for (long spins = 0; ibv_poll_cq(cq, 1, &wc) == 0; spins++) CHECK(spins < 100000000L);
    CHECK(wc.wr_id == 15 && wc.status == IBV_WC_SUCCESS);

    /* The same CQ through the plain API: an error completion via ibv_poll_cq. */
    wr.wr_id = 13;
    wr.wr.rdma.rkey = mb->rkey + 777;
    post(qa, &wr);
    for (long spins = 0; ibv_poll_cq(cq, 1, &wc) == 0; spins++) CHECK(spins < 100000000L);
    CHECK(wc.wr_id == 13 && wc.status == IBV_WC_REM_ACCESS_ERR);
    /* ... and the responder learns of it as an async event on its QP. The first bad-rkey
     * test's event named a QP destroyed since, so this is the first one delivered. */
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(ctx, &ev) == 0);
    CHECK(ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == qb);
    ibv_ack_async_event(&ev);
    CHECK(qb->events_completed == 1);
    /* No more events: with O_NONBLOCK on async_fd the call fails with EAGAIN at once. */
    fl = fcntl(ctx->async_fd, F_GETFL);
    CHECK(fl >= 0 && fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0);
    errno = 0;
    CHECK(ibv_get_async_event(ctx, &ev) == -1 && errno == EAGAIN);
    CHECK(fcntl(ctx->async_fd, F_SETFL, fl) == 0);

    CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
    CHECK(ibv_destroy_comp_channel(ch) == EBUSY);
    CHECK(ibv_destroy_cq(cq) == 0);
    CHECK(ibv_destroy_comp_channel(ch) == 0);
}

/* An SRQ armed with a limit raises IBV_EVENT_SRQ_LIMIT_REACHED, naming the SRQ, once fewer
 * receives than the limit remain. */
static void srq_limit_section(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_mr *ma,
                              struct ibv_mr *mb, union ibv_gid *gid) {
    struct ibv_srq_init_attr sa = {0};
    sa.attr.max_wr = 8;
    sa.attr.max_sge = 1;
    sa.attr.srq_limit = 2;
    struct ibv_srq *srq = ibv_create_srq(pd, &sa);
    CHECK(srq);
    cq = ibv_create_cq(ctx, 32, NULL, NULL, 0);
    CHECK(cq);
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 8;
    ia.cap.max_send_sge = 1;
    struct ibv_qp *qt = ibv_create_qp(pd, &ia);
    ia.srq = srq;
    struct ibv_qp *qs = ibv_create_qp(pd, &ia);
    CHECK(qt && qs);
    connect_rc_pair(qt, qs, gid, RC_ACCESS_ALL);
    struct ibv_sge rsge = {(uintptr_t)mb->addr, 64, mb->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 300, .sg_list = &rsge, .num_sge = 1}, *rbad;
    for (int i = 0; i < 3; i++) CHECK(ibv_post_srq_recv(srq, &rwr, &rbad) == 0);
    struct ibv_sge sge = {(uintptr_t)ma->addr, 8, ma->lkey};
    struct ibv_send_wr wr = {0};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    for (int i = 0; i < 2; i++) {
        wr.wr_id = 30 + i;
        post(qt, &wr);
    }
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(ctx, &ev) == 0);
    CHECK(ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && ev.element.srq == srq);
    ibv_ack_async_event(&ev);
    CHECK(srq->events_completed == 1);
    struct ibv_srq_attr sq;
    CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 0); /* disarmed by the event */
    struct ibv_wc wc[4];
    for (int got = 0; got < 4;) {
        int k = ibv_poll_cq(cq, 4, wc);
        CHECK(k >= 0);
        for (int i = 0; i < k; i++) CHECK(wc[i].status == IBV_WC_SUCCESS);
        got += k;
    }
    /* ibv_modify_srq re-arms the limit: one WQE is left, and taking it crosses 1. A resize,
     * a limit above max_wr, unknown bits and NULL are EINVAL. */
    struct ibv_srq_attr ma_ = {.srq_limit = 1};
    CHECK(ibv_modify_srq(srq, &ma_, IBV_SRQ_LIMIT) == 0);
    CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 1);
    struct ibv_srq_attr big = {.max_wr = 64, .srq_limit = 1000};
    CHECK(ibv_modify_srq(srq, &big, IBV_SRQ_MAX_WR) == EINVAL);
    CHECK(ibv_modify_srq(srq, &big, IBV_SRQ_LIMIT) == EINVAL);
    CHECK(ibv_modify_srq(srq, &ma_, IBV_SRQ_LIMIT | (1 << 5)) == EINVAL);
    CHECK(ibv_modify_srq(NULL, &ma_, IBV_SRQ_LIMIT) == EINVAL);
    CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 1 && sq.max_wr >= 8);
    wr.wr_id = 32;
    post(qt, &wr);
    CHECK(ibv_get_async_event(ctx, &ev) == 0);
    CHECK(ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && ev.element.srq == srq);
    ibv_ack_async_event(&ev);
    for (int got = 0; got < 2;) {
        int k = ibv_poll_cq(cq, 4, wc);
        CHECK(k >= 0);
        for (int i = 0; i < k; i++) CHECK(wc[i].status == IBV_WC_SUCCESS);
        got += k;
    }
    CHECK(ibv_destroy_qp(qs) == 0 && ibv_destroy_qp(qt) == 0);
    CHECK(ibv_destroy_cq(cq) == 0);
    CHECK(ibv_destroy_srq(srq) == 0);
}

/* A UD QP through INIT, RTR and RTS with qkey 0x11111111. */
static void ud_ready(struct ibv_qp *qp) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qkey = 0x11111111;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0);
    a.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0);
}

/* A UD SEND of `len` bytes at `addr` (key `lkey`) through `ah` to QP `qpn`; waits for its
 * completion and returns the receive completion that comes with it. */
static struct ibv_wc ud_send(struct ibv_qp *qp, struct ibv_cq *ucq, struct ibv_ah *ah,
                             uint32_t qpn, char *addr, uint32_t len, uint32_t lkey) {
    struct ibv_sge s = {(uintptr_t)addr, len, lkey};
    struct ibv_send_wr w = {0};
    w.wr_id = 50;
    w.sg_list = &s;
    w.num_sge = 1;
    w.opcode = IBV_WR_SEND;
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.ud.ah = ah;
    w.wr.ud.remote_qpn = qpn;
    w.wr.ud.remote_qkey = 0x11111111;
    post(qp, &w);
    struct ibv_wc recv = {0};
    for (int got = 0; got < 2; got++) {
        struct ibv_wc wc = poll1(ucq);
        CHECK(wc.status == IBV_WC_SUCCESS);
        if (wc.opcode == IBV_WC_RECV)
            recv = wc;
    }
    CHECK(recv.opcode == IBV_WC_RECV && recv.byte_len == 40 + len);
    return recv;
}

/* ibv_init_ah_from_wc / ibv_create_ah_from_wc: a UD server answers its client through the
 * address built from the client's receive completion and GRH. */
static void ud_reply_section(struct ibv_context *ctx, struct ibv_pd *pd, union ibv_gid *gid) {
    struct ibv_cq *ucq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(ucq);
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = ia.recv_cq = ucq;
    ia.qp_type = IBV_QPT_UD;
    ia.cap.max_send_wr = ia.cap.max_recv_wr = 4;
    ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    struct ibv_qp *client = ibv_create_qp(pd, &ia), *server = ibv_create_qp(pd, &ia);
    CHECK(client && server);
    ud_ready(client);
    ud_ready(server);
    char *buf = aligned_alloc(4096, 4096);
    CHECK(buf);
    memset(buf, 0, 4096);
    struct ibv_mr *m = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(m);
    struct ibv_sge cs = {(uintptr_t)buf, 128, m->lkey}, ss = {(uintptr_t)buf + 1024, 128, m->lkey};
    struct ibv_recv_wr cr = {.wr_id = 60, .sg_list = &cs, .num_sge = 1};
    struct ibv_recv_wr sr = {.wr_id = 61, .sg_list = &ss, .num_sge = 1}, *rbad;
    CHECK(ibv_post_recv(client, &cr, &rbad) == 0 && ibv_post_recv(server, &sr, &rbad) == 0);

    struct ibv_ah_attr to_server = {0};
    to_server.is_global = 1;
    to_server.grh.dgid = *gid;
    to_server.grh.hop_limit = 1;
    to_server.port_num = 1;
    struct ibv_ah *ah = ibv_create_ah(pd, &to_server);
    CHECK(ah);
    strcpy(buf + 2048, "ping");
    struct ibv_wc wc = ud_send(client, ucq, ah, server->qp_num, buf + 2048, 5, m->lkey);
    CHECK(wc.wr_id == 61 && (wc.wc_flags & IBV_WC_GRH) && wc.src_qp == client->qp_num);
    struct ibv_grh *grh = (struct ibv_grh *)(buf + 1024);

    struct ibv_ah_attr back;
    CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, grh, &back) == 0);
    CHECK(back.is_global == 1 && memcmp(&back.grh.dgid, gid, 16) == 0 &&
          back.grh.sgid_index == 0 && back.port_num == 1 && back.grh.hop_limit == 0xff);
    struct ibv_ah *reply = ibv_create_ah_from_wc(pd, &wc, grh, 1);
    CHECK(reply);
    strcpy(buf + 2048, "pong");
    wc = ud_send(server, ucq, reply, wc.src_qp, buf + 2048, 5, m->lkey);
    CHECK(wc.wr_id == 60 && strcmp(buf + 40, "pong") == 0);

    /* A GRH sent to a GID this port does not have, and NULL arguments: EINVAL. */
    struct ibv_grh other = *grh;
    other.dgid.raw[0] ^= 0xff;
    CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, &other, &back) == EINVAL);
    wc.wc_flags |= IBV_WC_GRH;
    CHECK(ibv_init_ah_from_wc(ctx, 1, &wc, NULL, &back) == EINVAL);
    CHECK(ibv_init_ah_from_wc(ctx, 1, NULL, grh, &back) == EINVAL);
    errno = 0;
    CHECK(ibv_create_ah_from_wc(pd, &wc, &other, 1) == NULL && errno == EINVAL);

    CHECK(ibv_destroy_ah(reply) == 0 && ibv_destroy_ah(ah) == 0);
    CHECK(ibv_destroy_qp(client) == 0 && ibv_destroy_qp(server) == 0);
    CHECK(ibv_destroy_cq(ucq) == 0);
    CHECK(ibv_dereg_mr(m) == 0);
    free(buf);
}

int main(void) {
    struct ibv_context *ctx = open_first_device();
    CHECK(strcmp(ibv_get_device_name(ctx->device), "softverbs0") == 0);
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0 && da.phys_port_cnt == 1 && da.max_qp > 0);
    struct ibv_device_attr_ex dax;
    CHECK(ibv_query_device_ex(ctx, NULL, &dax) == 0 && dax.orig_attr.max_qp == da.max_qp);
    CHECK(dax.completion_timestamp_mask != 0 && dax.hca_core_clock != 0);
    CHECK(dax.orig_attr.phys_port_cnt == 1 && dax.comp_mask == 0);
    struct ibv_query_device_ex_input qin = {.comp_mask = 1};
    CHECK(ibv_query_device_ex(ctx, &qin, &dax) == EINVAL);
    /* Real-time values: the raw device clock, masked like completion timestamps. */
    struct ibv_values_ex vals = {.comp_mask = IBV_VALUES_MASK_RAW_CLOCK};
    CHECK(ibv_query_rt_values_ex(ctx, &vals) == 0 && vals.comp_mask == IBV_VALUES_MASK_RAW_CLOCK);
    uint64_t raw1 = (uint64_t)vals.raw_clock.tv_sec * 1000000000ull + vals.raw_clock.tv_nsec;
    CHECK(raw1 != 0 && (raw1 & ~dax.completion_timestamp_mask) == 0);
    CHECK(ibv_query_rt_values_ex(ctx, &vals) == 0);
    uint64_t raw2 = (uint64_t)vals.raw_clock.tv_sec * 1000000000ull + vals.raw_clock.tv_nsec;
    CHECK(((raw2 - raw1) & dax.completion_timestamp_mask) < 60000000000ull);
    vals.comp_mask = IBV_VALUES_MASK_RESERVED;
    CHECK(ibv_query_rt_values_ex(ctx, &vals) == EINVAL);
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0);
    CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET);
    CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL);
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[15] == 1);
    struct ibv_gid_entry ge;
    CHECK(ibv_query_gid_ex(ctx, 1, 0, &ge, 0) == 0 && memcmp(&ge.gid, &gid, 16) == 0);
    CHECK(ge.port_num == 1 && ge.gid_index == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2);
    CHECK(ibv_query_gid_ex(ctx, 1, 5, &ge, 0) == EINVAL);
    struct ibv_gid_entry table[4];
    CHECK(ibv_query_gid_table(ctx, table, 4, 0) == 1 && memcmp(&table[0].gid, &gid, 16) == 0);
    uint16_t pkey;
    CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == 0xffff);
    CHECK(ibv_get_pkey_index(ctx, 1, htons(0xffff)) == 0);
    errno = 0;
    CHECK(ibv_get_pkey_index(ctx, 1, htons(0x8001)) == -1 && errno == ENOENT);
    errno = 0;
    CHECK(ibv_get_pkey_index(ctx, 2, htons(0xffff)) == -1 && errno == EINVAL);

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
    /* Optional bits: the header routes this ibv_reg_mr through ibv_reg_mr_iova2@IBVERBS_1.8;
     * unsupported optional bits are dropped, unknown mandatory bits are EINVAL. */
    struct ibv_mr *ro = ibv_reg_mr(pd, b, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
    CHECK(ro && ro->addr == b && ibv_dereg_mr(ro) == 0);
    ro = ibv_reg_mr_iova2(pd, b, len, 0x10000,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING | (1u << 29));
    CHECK(ro && ro->length == len && ibv_dereg_mr(ro) == 0);
    errno = 0;
    CHECK(ibv_reg_mr_iova2(pd, b, len, 0x10000, IBV_ACCESS_LOCAL_WRITE | (1u << 15)) == NULL &&
          errno == EINVAL);
    struct ibv_mr *ma = ibv_reg_mr(pd, a, len, RC_ACCESS_ALL);
    struct ibv_mr *mb = ibv_reg_mr(pd, b, len, RC_ACCESS_ALL);
    CHECK(ma && mb);

    cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(cq && cq->cqe >= 64);
    /* ibv_resize_cq: the new size in cq->cqe (the traffic below uses the resized CQ); bad
     * sizes and pointers are EINVAL and change nothing. */
    CHECK(ibv_resize_cq(cq, 200) == 0 && cq->cqe >= 200);
    CHECK(ibv_resize_cq(cq, 0) == EINVAL && ibv_resize_cq(cq, -1) == EINVAL);
    CHECK(ibv_resize_cq(cq, da.max_cqe + 1) == EINVAL && cq->cqe >= 200);
    CHECK(ibv_resize_cq(NULL, 10) == EINVAL);
    struct ibv_qp *qa, *qb;
    create_rc_pair(pd, cq, &qa, &qb);

    /* Wrong transition: RESET -> RTR. */
    struct ibv_qp_attr bad = {0};
    bad.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(qa, &bad, IBV_QP_STATE) == EINVAL);

    connect_rc_pair(qa, qb, &gid, RC_ACCESS_ALL);
    /* No in-order placement promise; no ECE. */
    CHECK(ibv_query_qp_data_in_order(qa, IBV_WR_RDMA_WRITE, 0) == 0);
    struct ibv_ece ece;
    CHECK(ibv_query_ece(qa, &ece) == EOPNOTSUPP && ibv_set_ece(qa, &ece) == EOPNOTSUPP);
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

    /* ibv_rereg_mr: access, then translation, each in force for an RDMA WRITE by the region's
     * (possibly new) rkey; bad calls are IBV_REREG_MR_ERR_INPUT with errno and change nothing. */
    char *c = aligned_alloc(4096, 8192);
    CHECK(c);
    memset(c, 0, 8192);
    struct ibv_mr *mc = ibv_reg_mr(pd, c, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mc);
    CHECK(ibv_rereg_mr(mc, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, RC_ACCESS_ALL) == 0);
    wr.wr_id = 3;
    wr.wr.rdma.remote_addr = (uintptr_t)(c + 64);
    wr.wr.rdma.rkey = mc->rkey;
    post(qa, &wr);
    wait_wc(IBV_WC_RDMA_WRITE, 3);
    CHECK(strcmp(c + 64, "written") == 0);
    CHECK(ibv_rereg_mr(mc, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, c + 4096, 4096, 0) == 0);
    CHECK(mc->addr == c + 4096 && mc->length == 4096 && mc->lkey == mc->rkey);
    wr.wr_id = 4;
    wr.wr.rdma.remote_addr = (uintptr_t)(c + 4096 + 8);
    wr.wr.rdma.rkey = mc->rkey;
    post(qa, &wr);
    wait_wc(IBV_WC_RDMA_WRITE, 4);
    CHECK(strcmp(c + 4096 + 8, "written") == 0);
    uint32_t key = mc->rkey;
    errno = 0;
    CHECK(ibv_rereg_mr(mc, 1 << 5, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT && errno == EINVAL);
    errno = 0; /* remote write without local write */
    CHECK(ibv_rereg_mr(mc, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_REMOTE_WRITE) ==
              IBV_REREG_MR_ERR_INPUT &&
          errno == EINVAL);
    CHECK(ibv_rereg_mr(mc, 0, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT);
    CHECK(ibv_rereg_mr(NULL, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, 0) ==
          IBV_REREG_MR_ERR_INPUT);
    CHECK(mc->rkey == key && mc->addr == c + 4096 && mc->length == 4096);
    CHECK(ibv_dereg_mr(mc) == 0);
    free(c);
    wr.wr.rdma.rkey = mb->rkey; /* as the next steps expect */

    /* Plain SEND, then RDMA WRITE_WITH_IMM, which consumes a receive without its buffer. */
    rwr.wr_id = 101;
    CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0);
    rwr.wr_id = 102;
    CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0);
    strcpy(a, "plain!!");
    wr.wr_id = 7;
    wr.opcode = IBV_WR_SEND;
    post(qa, &wr);
    strcpy(a, "with imm");
    sge.length = 9;
    wr.wr_id = 8;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(0xabcd);
    wr.wr.rdma.remote_addr = (uintptr_t)(b + 192);
    post(qa, &wr);
    int seen = 0;
    while (seen != 15) {
        struct ibv_wc w;
        int k = ibv_poll_cq(cq, 1, &w);
        CHECK(k >= 0);
        if (k == 0) continue;
        CHECK(w.status == IBV_WC_SUCCESS);
        if (w.wr_id == 7) {
            CHECK(w.opcode == IBV_WC_SEND);
            seen |= 1;
        } else if (w.wr_id == 8) {
            CHECK(w.opcode == IBV_WC_RDMA_WRITE);
            seen |= 2;
        } else if (w.wr_id == 101) {
            CHECK(w.opcode == IBV_WC_RECV && w.byte_len == 8 && !(w.wc_flags & IBV_WC_WITH_IMM));
            seen |= 4;
        } else {
            CHECK(w.wr_id == 102 && w.opcode == IBV_WC_RECV_RDMA_WITH_IMM && w.byte_len == 9);
            CHECK((w.wc_flags & IBV_WC_WITH_IMM) && ntohl(w.imm_data) == 0xabcd);
            seen |= 8;
        }
    }
    CHECK(strcmp(b, "plain!!") == 0 && strcmp(b + 192, "with imm") == 0);
    memset(&wr, 0, sizeof wr);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    sge.length = 8;
    wr.wr.rdma.rkey = mb->rkey;

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

    cq_ex_section(ctx, pd, ma, mb, &gid);
    srq_limit_section(ctx, pd, ma, mb, &gid);
    ud_reply_section(ctx, pd, &gid);

    CHECK(ibv_dereg_mr(ma) == 0 && ibv_dereg_mr(mb) == 0);
    CHECK(ibv_dealloc_pd(pd) == 0);
    CHECK(ibv_close_device(ctx) == 0);
    printf("ok\n");
    return 0;
}
