/* The rsocket calls rstream and riostream do not reach, in one process with two threads
 * (a server and a client on 127.0.0.1): addresses, options and their errors, rpoll and
 * rselect mixed with a pipe, writev, a multi-megabyte reply under credit flow control,
 * SHUT_WR as end of stream at the peer, MSG_PEEK, refused connections, non-blocking
 * EAGAIN, bad descriptors, and both directions of one connection at once, from two
 * threads at each end.
 * Prints "ok" and exits 0, or says what failed and exits 1. Run under `softverbs run`. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rsocket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <sys/uio.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "%s:%d: %s failed (errno %d: %s)\n", \
	__FILE__, __LINE__, #c, errno, strerror(errno)); exit(1); } } while (0)

#define REPLY (3 << 20)
#define DUPLEX (4 << 20)
static unsigned short port;

struct xfer { int s; unsigned char *buf; };

static void *send_all(void *arg)
{
	struct xfer *x = arg;

	for (long i = 0; i < DUPLEX; i++)
		x->buf[i] = (unsigned char) (i * 13 + 1);
	CHECK(rsend(x->s, x->buf, DUPLEX, 0) == DUPLEX);
	return NULL;
}

/* Both directions of one socket at once: a thread sends while this one receives. */
static void duplex(int s)
{
	struct xfer x = { s, malloc(DUPLEX) };
	unsigned char *in = malloc(DUPLEX);
	long got = 0;
	pthread_t t;
	ssize_t n;

	CHECK(x.buf && in);
	CHECK(pthread_create(&t, NULL, send_all, &x) == 0);
	while (got < DUPLEX) {
		n = rrecv(s, in + got, DUPLEX - got, 0);
		CHECK(n > 0);
		got += n;
	}
	CHECK(pthread_join(t, NULL) == 0);
	for (long i = 0; i < DUPLEX; i++)
		CHECK(in[i] == (unsigned char) (i * 13 + 1));
	free(x.buf);
	free(in);
}

static void *duplex_client(void *arg)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int s = rsocket(AF_INET, SOCK_STREAM, 0), val = 4;

	(void) arg;
	CHECK(s >= 0);
	/* The smallest window each way: every credit rule is needed. */
	CHECK(rsetsockopt(s, SOL_RDMA, RDMA_RQSIZE, &val, sizeof val) == 0);
	CHECK(rsetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &val, sizeof val) == 0);
	CHECK(rconnect(s, (struct sockaddr *) &sin, sizeof sin) == 0);
	duplex(s);
	CHECK(rclose(s) == 0);
	return NULL;
}

static void *client(void *arg)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct sockaddr_in peer;
	socklen_t len = sizeof peer;
	struct iovec iov[2] = { { "wor", 3 }, { "ld", 2 } };
	unsigned char *buf = malloc(REPLY);
	long got = 0;
	ssize_t n;
	int s;

	(void) arg;
	CHECK(buf);
	s = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(s >= 0);
	CHECK(rconnect(s, (struct sockaddr *) &sin, sizeof sin) == 0);
	CHECK(rgetpeername(s, (struct sockaddr *) &peer, &len) == 0);
	CHECK(len == sizeof peer && peer.sin_port == htons(port));
	CHECK(rsend(s, "hello", 5, 0) == 5);
	CHECK(rwritev(s, iov, 2) == 5);
	CHECK(rshutdown(s, SHUT_WR) == 0);
	CHECK(rsend(s, "x", 1, 0) == -1 && errno == EPIPE);
	{
		/* A peek through two iovecs leaves the bytes for the reads below. */
		unsigned char a[2], b[2];
		struct iovec piov[2] = { { a, 2 }, { b, 2 } };
		struct msghdr m = { .msg_iov = piov, .msg_iovlen = 2 };

		CHECK(rrecvmsg(s, &m, MSG_PEEK) == 4);
		CHECK(a[0] == 0 && a[1] == 7 && b[0] == 14 && b[1] == 21);
	}
	while ((n = rrecv(s, buf + got, REPLY - got, 0)) > 0)
		got += n;
	CHECK(n == 0 && got == REPLY);
	for (long i = 0; i < REPLY; i++)
		CHECK(buf[i] == (unsigned char) (i * 7));
	CHECK(rclose(s) == 0);
	free(buf);
	return NULL;
}

int main(void)
{
	struct sockaddr_in sin = { .sin_family = AF_INET,
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct sockaddr_in me, peer;
	socklen_t len = sizeof me;
	int ls, s, val, pipefd[2];
	unsigned char *reply = malloc(REPLY);
	char msg[16] = { 0 };
	struct pollfd fds[2];
	pthread_t t;
	fd_set rd;
	struct timeval tv = { 5, 0 };
	ssize_t n;
	int got = 0;

	CHECK(reply);
	/* Bad descriptors and arguments. */
	CHECK(rrecv(-1, msg, 1, 0) == -1 && errno == EBADF);
	CHECK(rclose(1000) == -1 && errno == EBADF);
	CHECK(rsocket(AF_INET, SOCK_DGRAM, 0) == -1 && errno == EOPNOTSUPP);

	ls = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(ls >= 0);
	/* A real descriptor: open, and no other file gets its number. */
	CHECK(fcntl(ls, F_GETFD) >= 0);
	val = open("/dev/null", O_RDONLY);
	CHECK(val >= 0 && val != ls);
	close(val);

	val = 1;
	CHECK(rsetsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &val, sizeof val) == 0);
	CHECK(rsetsockopt(ls, SOL_SOCKET, SO_REUSEADDR, NULL, sizeof val) == -1 && errno == EFAULT);
	CHECK(rsetsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &val, 1) == -1 && errno == EINVAL);
	CHECK(rsetsockopt(ls, SOL_SOCKET, SO_BROADCAST, &val, sizeof val) == -1 && errno == ENOPROTOOPT);
	CHECK(rsetsockopt(ls, 12345, 1, &val, sizeof val) == -1 && errno == ENOPROTOOPT);
	CHECK(rsetsockopt(ls, IPPROTO_TCP, TCP_NODELAY, &val, sizeof val) == 0);
	len = sizeof val;
	val = 0;
	CHECK(rgetsockopt(ls, IPPROTO_TCP, TCP_NODELAY, &val, &len) == 0 && val == 1);
	CHECK(rgetsockopt(ls, SOL_SOCKET, SO_TYPE, &val, &len) == 0 && val == SOCK_STREAM);
	CHECK(rgetsockopt(ls, SOL_SOCKET, SO_ERROR, &val, &len) == 0 && val == 0);
	val = 8;
	CHECK(rsetsockopt(ls, SOL_RDMA, RDMA_SQSIZE, &val, sizeof val) == 0);
	CHECK(rsetsockopt(ls, SOL_RDMA, RDMA_RQSIZE, &val, sizeof val) == 0);

	CHECK(rbind(ls, (struct sockaddr *) &sin, 4) == -1 && errno == EINVAL);
	CHECK(rbind(ls, (struct sockaddr *) &sin, sizeof sin) == 0);
	CHECK(rlisten(ls, 4) == 0);
	len = sizeof me;
	CHECK(rgetsockname(ls, (struct sockaddr *) &me, &len) == 0);
	CHECK(me.sin_family == AF_INET && me.sin_port != 0);
	port = ntohs(me.sin_port);

	/* Nobody listens on the next port: refused, and the socket cannot be reused. */
	{
		struct sockaddr_in none = me;
		int c = rsocket(AF_INET, SOCK_STREAM, 0);

		none.sin_port = htons(port + 1);
		CHECK(c >= 0);
		CHECK(rconnect(c, (struct sockaddr *) &none, sizeof none) == -1 && errno == ECONNREFUSED);
		CHECK(rsend(c, "x", 1, 0) == -1 && errno == ENOTCONN);
		CHECK(rclose(c) == 0);
	}

	/* Non-blocking accept with nobody there. */
	CHECK(rfcntl(ls, F_SETFL, O_NONBLOCK) == 0);
	CHECK((rfcntl(ls, F_GETFL) & O_NONBLOCK) != 0);
	CHECK(raccept(ls, NULL, NULL) == -1 && errno == EAGAIN);
	CHECK(rfcntl(ls, F_SETFL, 0) == 0);

	CHECK(pthread_create(&t, NULL, client, NULL) == 0);
	/* The listener polls readable when a request waits. */
	fds[0].fd = ls;
	fds[0].events = POLLIN;
	CHECK(rpoll(fds, 1, 10000) == 1 && (fds[0].revents & POLLIN));
	len = sizeof peer;
	s = raccept(ls, (struct sockaddr *) &peer, &len);
	CHECK(s >= 0 && s != ls);
	CHECK(len == sizeof peer && peer.sin_family == AF_INET);

	/* rpoll over a pipe that stays quiet and the rsocket, which gets data. */
	CHECK(pipe(pipefd) == 0);
	while (got < 10) {
		fds[0].fd = pipefd[0];
		fds[0].events = POLLIN;
		fds[1].fd = s;
		fds[1].events = POLLIN;
		CHECK(rpoll(fds, 2, 10000) == 1);
		CHECK(fds[0].revents == 0 && (fds[1].revents & POLLIN));
		n = rrecv(s, msg + got, sizeof msg - got, MSG_DONTWAIT);
		CHECK(n > 0 || (n == -1 && errno == EAGAIN));
		if (n > 0)
			got += n;
	}
	CHECK(memcmp(msg, "helloworld", 10) == 0);
	/* SHUT_WR at the peer: end of stream, readable in rselect. */
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	CHECK(rselect(s + 1, &rd, NULL, NULL, &tv) == 1 && FD_ISSET(s, &rd));
	CHECK(rrecv(s, msg, sizeof msg, 0) == 0);
	CHECK(rrecv(s, msg, sizeof msg, 0) == 0);

	/* A reply far larger than the window (8 slots of 32 KiB): credits must flow. */
	for (long i = 0; i < REPLY; i++)
		reply[i] = (unsigned char) (i * 7);
	CHECK(rsend(s, reply, REPLY, 0) == REPLY);
	CHECK(rclose(s) == 0);
	CHECK(pthread_join(t, NULL) == 0);
	CHECK(rrecv(s, msg, 1, 0) == -1 && errno == EBADF);

	/* Two threads on each end of one connection, windows of 4 slots. */
	val = 4;
	CHECK(rsetsockopt(ls, SOL_RDMA, RDMA_RQSIZE, &val, sizeof val) == 0);
	CHECK(pthread_create(&t, NULL, duplex_client, NULL) == 0);
	s = raccept(ls, NULL, NULL);
	CHECK(s >= 0);
	duplex(s);
	CHECK(pthread_join(t, NULL) == 0);
	CHECK(rclose(s) == 0);
	CHECK(rclose(ls) == 0);
	close(pipefd[0]);
	close(pipefd[1]);
	free(reply);
	printf("ok\n");
	return 0;
}
