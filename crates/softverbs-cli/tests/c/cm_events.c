/* What a connection-manager program sees when things go wrong, for rdmacm_tools.rs.
 *
 *   cm_events server PORT accept|reject|hold   listen on PORT; accept each request (then
 *                                              wait for DISCONNECTED), reject it with
 *                                              private data, or accept and wait to be killed
 *   cm_events client ADDR PORT                 connect with private data; print each event
 *   cm_events mcast ADDR GROUP                 multicast joins' rules (see mcast()); prints
 *                                              "mcast ok" or the first rule broken
 *
 * Every event is printed as one line:
 *   event NAME status N private 'TEXT' after MS ms
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

static double t0;

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(const char *what)
{
	printf("error %s: %s\n", what, strerror(errno));
	exit(1);
}

/* The next event, or NULL after timeout_ms. */
static struct rdma_cm_event *next_event(struct rdma_event_channel *ch, int timeout_ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *e;

	if (poll(&p, 1, timeout_ms) <= 0)
		return NULL;
	if (rdma_get_cm_event(ch, &e))
		die("rdma_get_cm_event");
	return e;
}

static void show(struct rdma_cm_event *e)
{
	const char *pd = e->param.conn.private_data;
	int n = pd ? (int)strnlen(pd, e->param.conn.private_data_len) : 0;

	printf("event %s status %d private '%.*s' after %.0f ms\n", rdma_event_str(e->event),
	       e->status, n, pd ? pd : "", now_ms() - t0);
	fflush(stdout);
}

static void make_qp(struct rdma_cm_id *id)
{
	struct ibv_qp_init_attr a;

	memset(&a, 0, sizeof a);
	a.cap.max_send_wr = a.cap.max_recv_wr = 4;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	if (rdma_create_qp(id, NULL, &a))
		die("rdma_create_qp");
}

static int server(int port, const char *mode)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	struct rdma_cm_id *listen_id;
	struct rdma_cm_event *e;

	if (!ch || rdma_create_id(ch, &listen_id, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	if (rdma_bind_addr(listen_id, (struct sockaddr *)&sin) || rdma_listen(listen_id, 0))
		die("listen");
	printf("listening\n");
	fflush(stdout);
	while ((e = next_event(ch, -1))) {
		struct rdma_cm_id *id = e->id;
		int kind = e->event;

		show(e);
		if (kind == RDMA_CM_EVENT_CONNECT_REQUEST && !strcmp(mode, "reject")) {
			rdma_ack_cm_event(e);
			if (rdma_reject(id, "no thanks", 10))
				die("rdma_reject");
			continue;
		}
		if (kind == RDMA_CM_EVENT_CONNECT_REQUEST) {
			struct rdma_conn_param p = { .private_data = "welcome",
						     .private_data_len = 8,
						     .responder_resources = 1,
						     .initiator_depth = 1,
						     .rnr_retry_count = 7 };
			rdma_ack_cm_event(e);
			make_qp(id);
			if (rdma_accept(id, &p))
				die("rdma_accept");
			continue;
		}
		rdma_ack_cm_event(e);
		if (kind == RDMA_CM_EVENT_ESTABLISHED && !strcmp(mode, "hold"))
			for (;;)
				pause();
		if (kind == RDMA_CM_EVENT_DISCONNECTED) {
			rdma_disconnect(id);
			return 0;
		}
	}
	return 1;
}

static int client(const char *addr, int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	struct rdma_conn_param p = { .private_data = "hello",
				     .private_data_len = 6,
				     .responder_resources = 1,
				     .initiator_depth = 1,
				     .retry_count = 7,
				     .rnr_retry_count = 7 };
	struct rdma_cm_id *id;
	struct rdma_cm_event *e;

	if (inet_pton(AF_INET, addr, &sin.sin_addr) != 1)
		die("inet_pton");
	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&sin, 2000))
		die("rdma_resolve_addr");
	if (!(e = next_event(ch, 5000)))
		die("no address event");
	show(e);
	rdma_ack_cm_event(e);
	if (rdma_resolve_route(id, 2000))
		die("rdma_resolve_route");
	if (!(e = next_event(ch, 5000)))
		die("no route event");
	show(e);
	rdma_ack_cm_event(e);
	make_qp(id);
	t0 = now_ms();
	if (rdma_connect(id, &p))
		die("rdma_connect");
	/* The connection's outcome, then (if it is up) what ends it. */
	for (int i = 0; i < 2 && (e = next_event(ch, 30000)); i++) {
		int kind = e->event;

		show(e);
		rdma_ack_cm_event(e);
		if (kind != RDMA_CM_EVENT_ESTABLISHED)
			break;
		t0 = now_ms();
	}
	rdma_disconnect(id);
	return 0;
}

#define EXPECT(c) do { if (!(c)) { printf("mcast: %s failed (errno %d)\n", #c, errno); return 1; } } while (0)

/* rdma_join_multicast on a UDP id bound to ADDR: MULTICAST_JOIN with the context, the group's
 * GID, the multicast QPN and the UDP Q_Key; joining twice is EADDRINUSE; a unicast address, an
 * unbound id and a TCP id are EINVAL; rdma_destroy_qp before leaving works (the library
 * detaches the QP: an attached QP cannot be destroyed); leaving twice is EADDRNOTAVAIL. */
static int mcast(const char *addr, const char *group)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *id, *tcp, *unbound;
	struct sockaddr_in src = { .sin_family = AF_INET }, grp = { .sin_family = AF_INET };
	struct sockaddr_in uni = { .sin_family = AF_INET };
	int ctx_marker = 0;

	EXPECT(ch);
	EXPECT(inet_pton(AF_INET, addr, &src.sin_addr) == 1);
	EXPECT(inet_pton(AF_INET, group, &grp.sin_addr) == 1);
	uni.sin_addr = src.sin_addr;
	EXPECT(rdma_create_id(ch, &id, NULL, RDMA_PS_UDP) == 0);
	EXPECT(rdma_create_id(ch, &unbound, NULL, RDMA_PS_UDP) == 0);
	EXPECT(rdma_create_id(ch, &tcp, NULL, RDMA_PS_TCP) == 0);
	EXPECT(rdma_join_multicast(unbound, (struct sockaddr *)&grp, NULL) == -1 && errno == EINVAL);
	EXPECT(rdma_bind_addr(id, (struct sockaddr *)&src) == 0);
	EXPECT(rdma_bind_addr(tcp, (struct sockaddr *)&src) == 0);
	EXPECT(rdma_join_multicast(tcp, (struct sockaddr *)&grp, NULL) == -1 && errno == EINVAL);
	EXPECT(rdma_join_multicast(id, (struct sockaddr *)&uni, NULL) == -1 && errno == EINVAL);
	/* As mckey does: resolving the group from the bound address picks the device (a
	 * loopback-bound id has none before). */
	EXPECT(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&grp, 2000) == 0);
	struct rdma_cm_event *r = next_event(ch, 2000);
	EXPECT(r && r->event == RDMA_CM_EVENT_ADDR_RESOLVED);
	rdma_ack_cm_event(r);

	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.cap.max_send_wr = a.cap.max_recv_wr = 4;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_UD;
	EXPECT(rdma_create_qp(id, NULL, &a) == 0);
	EXPECT(rdma_join_multicast(id, (struct sockaddr *)&grp, &ctx_marker) == 0);
	struct rdma_cm_event *e = next_event(ch, 2000);
	EXPECT(e && e->event == RDMA_CM_EVENT_MULTICAST_JOIN && e->status == 0);
	EXPECT(e->param.ud.private_data == &ctx_marker);
	EXPECT(e->param.ud.qp_num == 0xffffff && e->param.ud.qkey == RDMA_UDP_QKEY);
	EXPECT(e->param.ud.ah_attr.is_global);
	const uint8_t *g = e->param.ud.ah_attr.grh.dgid.raw;
	EXPECT(g[10] == 0xff && g[11] == 0xff && !memcmp(g + 12, &grp.sin_addr, 4));
	rdma_ack_cm_event(e);
	EXPECT(rdma_join_multicast(id, (struct sockaddr *)&grp, NULL) == -1 && errno == EADDRINUSE);
	rdma_destroy_qp(id);
	EXPECT(id->qp == NULL);
	EXPECT(rdma_leave_multicast(id, (struct sockaddr *)&grp) == 0);
	EXPECT(rdma_leave_multicast(id, (struct sockaddr *)&grp) == -1 && errno == EADDRNOTAVAIL);
	EXPECT(rdma_destroy_id(id) == 0 && rdma_destroy_id(tcp) == 0 && rdma_destroy_id(unbound) == 0);
	rdma_destroy_event_channel(ch);
	printf("mcast ok\n");
	return 0;
}

int main(int argc, char **argv)
{
	t0 = now_ms();
	if (argc == 4 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]), argv[3]);
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]));
	if (argc == 4 && !strcmp(argv[1], "mcast"))
		return mcast(argv[2], argv[3]);
	fprintf(stderr, "usage: cm_events server PORT accept|reject|hold | client ADDR PORT\n");
	return 2;
}
