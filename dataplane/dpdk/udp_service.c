/* SPDX-License-Identifier: BSD-3-Clause
 *
 * thc_udp_service: the switch core (agg_core.c) serving one kernel UDP socket,
 * with the semantics of dataplane/udp_service.py (the reference behind a socket)
 * and without DPDK, root or network namespaces.
 *
 *   thc_udp_service --config FILE --bind IP:PORT [--stats FILE] [--parent PID]
 *
 * The kernel owns Ethernet/IPv4/UDP, so each datagram is put behind the headers a
 * switch would have seen: the sender's real IPv4 address and UDP port (membership
 * is that address, as in the Python service), the ToS the socket reports
 * (IP_RECVTOS), switch port 0 and the member's configured MAC (the MAC is the
 * kernel's). What the core emits goes out by sendmmsg to the IPv4 address and UDP
 * port in its headers, with its ToS (docs/protocol.md §5). A datagram whose frame
 * would exceed 9216 bytes is drop_oversize; there is no DLCP stage (the kernel
 * queues) and no ordinary forwarding.
 *
 * Start-up prints "serving IP:PORT ... running" (PORT is the kernel's pick for
 * port 0). Statistics go to --stats (JSON, write-then-rename, a "seq" that counts
 * up) on SIGUSR1 and on exit (SIGTERM, SIGINT); without --stats, to stdout.
 * --parent PID: it stops, as on SIGTERM, within a tick (0.1 s) of that process, the one
 * that started it, ending (a Python caller that dies without stopping the service leaves no
 * service behind; a process, not PR_SET_PDEATHSIG's thread, which ends with the thread
 * that started it).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "agg_core.h"

#define BURST        32                      /* datagrams per recvmmsg */
/* One input emits at most a RESULT per member or one notice: room for that is
 * left before each input is processed, so nothing the core emits is skipped. */
#define OUT_FRAMES   (2 * BURST + AGG_MAX_WORKERS)
#define SOCKET_BUF   (8 << 20)               /* absorb a whole tensor's burst */
/* The longest datagram a switch would take (its frame at most 9216 bytes), plus
 * one byte so that a longer one shows as truncated. */
#define MAX_DATAGRAM (AGG_MAX_WIRE_FRAME - AGG_L2L4_LEN)
#define RX_ROOM      (MAX_DATAGRAM + 1)

static volatile sig_atomic_t stop_requested, stats_requested;

static void on_signal(int signum)
{
	if (signum == SIGUSR1)
		stats_requested = 1;
	else
		stop_requested = 1;
}

struct service_counters {
	uint64_t rx_datagrams, tx_datagrams, tx_errors;
};

/* What the core emitted for the datagrams of one burst: whole frames, sent as
 * datagrams (their payload after the 42 header bytes) to the address inside. */
struct outbox {
	uint8_t frames[OUT_FRAMES][AGG_MAX_FRAME];
	uint16_t len[OUT_FRAMES];
	uint32_t count;
};

static uint8_t *outbox_alloc(void *ctx, uint16_t port, uint16_t len)
{
	struct outbox *o = ctx;
	if (o->count == OUT_FRAMES || len > AGG_MAX_FRAME)
		return NULL;
	o->len[o->count] = len;
	return o->frames[o->count++];
}

static void flush_outbox(int fd, struct outbox *o, struct service_counters *c)
{
	static struct mmsghdr msgs[OUT_FRAMES];
	static struct iovec iov[OUT_FRAMES];
	static struct sockaddr_in to[OUT_FRAMES];
	static union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control[OUT_FRAMES];
	for (uint32_t i = 0; i < o->count; i++) {
		const uint8_t *f = o->frames[i], *ip = f + ETH_HLEN_, *udp = ip + IPV4_HLEN_;
		memset(&to[i], 0, sizeof(to[i]));
		to[i].sin_family = AF_INET;
		memcpy(&to[i].sin_addr, ip + 16, 4);         /* both in network order */
		memcpy(&to[i].sin_port, udp + 2, 2);
		iov[i].iov_base = (void *)(f + AGG_L2L4_LEN);
		iov[i].iov_len = (size_t)o->len[i] - AGG_L2L4_LEN;
		struct msghdr *m = &msgs[i].msg_hdr;
		memset(m, 0, sizeof(*m));
		m->msg_name = &to[i];
		m->msg_namelen = sizeof(to[i]);
		m->msg_iov = &iov[i];
		m->msg_iovlen = 1;
		if (ip[1]) {            /* the causing packet's DSCP and ECN (§5) */
			m->msg_control = control[i].buf;
			m->msg_controllen = sizeof(control[i].buf);
			struct cmsghdr *cm = CMSG_FIRSTHDR(m);
			cm->cmsg_level = IPPROTO_IP;
			cm->cmsg_type = IP_TOS;
			cm->cmsg_len = CMSG_LEN(sizeof(int));
			int tos = ip[1];
			memcpy(CMSG_DATA(cm), &tos, sizeof(tos));
		}
	}
	/* sendmmsg stops at a failing datagram (e.g. ECONNREFUSED left by an earlier
	 * ICMP error): count it and go on with the next. */
	for (uint32_t i = 0; i < o->count;) {
		int sent = sendmmsg(fd, msgs + i, o->count - i, 0);
		if (sent < 0) {
			if (errno == EINTR)
				continue;
			c->tx_errors++;
			i++;
			continue;
		}
		c->tx_datagrams += (uint64_t)sent;
		i += (uint32_t)sent;
	}
	o->count = 0;
}

/* The headers a switch port would have delivered the datagram with. The source
 * MAC is the configured member's that the AGG header names (the kernel's MAC is
 * not ours to check), so membership rests on the IPv4 address and UDP port. */
static void write_ingress_headers(const struct agg_switch *sw, uint8_t *f, uint32_t payload,
				  const struct sockaddr_in *from, uint8_t tos)
{
	memcpy(f, sw->mac, 6);
	memset(f + 6, 0, 6);
	if (payload >= AGG_HEADER_LEN) {
		const uint8_t *h = f + AGG_L2L4_LEN;
		int32_t ji = sw->job_index[(uint16_t)(h[H_JOB] << 8 | h[H_JOB + 1])];
		uint8_t w = h[H_WORKER];
		if (ji >= 0 && w < AGG_MAX_WORKERS && sw->jobs[ji].members[w].valid)
			memcpy(f + 6, sw->jobs[ji].members[w].mac, 6);
	}
	f[12] = 0x08;
	f[13] = 0x00;
	uint8_t *ip = f + ETH_HLEN_, *udp = ip + IPV4_HLEN_;
	uint16_t udp_len = (uint16_t)(UDP_HLEN_ + payload);
	ip[0] = 0x45;
	ip[1] = tos;
	ip[2] = (uint8_t)((IPV4_HLEN_ + udp_len) >> 8);
	ip[3] = (uint8_t)(IPV4_HLEN_ + udp_len);
	memset(ip + 4, 0, 4);            /* whole datagrams: the kernel reassembled them */
	ip[8] = 64;
	ip[9] = 17;
	memset(ip + 10, 0, 2);
	memcpy(ip + 12, &from->sin_addr, 4);
	uint32_t own = htonl(sw->ip);
	memcpy(ip + 16, &own, 4);
	memcpy(udp, &from->sin_port, 2);
	udp[2] = (uint8_t)(AGG_PORT_BASE >> 8);      /* the socket took it: it is ours */
	udp[3] = (uint8_t)AGG_PORT_BASE;
	udp[4] = (uint8_t)(udp_len >> 8);
	udp[5] = (uint8_t)udp_len;
	memset(udp + 6, 0, 2);
}

static int open_socket(const char *bind_to, struct sockaddr_in *addr)
{
	char host[64];
	const char *colon = strrchr(bind_to, ':');
	if (colon == NULL || (size_t)(colon - bind_to) >= sizeof(host)) {
		fprintf(stderr, "thc_udp_service: --bind %s: give IP:PORT\n", bind_to);
		return -1;
	}
	memcpy(host, bind_to, (size_t)(colon - bind_to));
	host[colon - bind_to] = '\0';
	char *end;
	long port = strtol(colon + 1, &end, 10);
	memset(addr, 0, sizeof(*addr));
	addr->sin_family = AF_INET;
	addr->sin_port = htons((uint16_t)port);
	if (*end != '\0' || port < 0 || port > 65535 || inet_pton(AF_INET, host, &addr->sin_addr) != 1) {
		fprintf(stderr, "thc_udp_service: --bind %s: give an IPv4 address and a port "
			"0-65535 (0: the kernel picks)\n", bind_to);
		return -1;
	}
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0) {
		perror("thc_udp_service: socket");
		return -1;
	}
	int size = SOCKET_BUF, on = 1;
	setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));   /* the kernel caps it */
	setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
	setsockopt(fd, IPPROTO_IP, IP_RECVTOS, &on, sizeof(on));
	/* A wait ends at least this often, so a stop or a statistics request that
	 * comes just before the loop blocks is seen without traffic. */
	struct timeval tick = { .tv_sec = 0, .tv_usec = 100000 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof(tick));
	socklen_t len = sizeof(*addr);
	if (bind(fd, (struct sockaddr *)addr, sizeof(*addr)) != 0 ||
	    getsockname(fd, (struct sockaddr *)addr, &len) != 0) {
		fprintf(stderr, "thc_udp_service: cannot bind %s: %s\n", bind_to, strerror(errno));
		close(fd);
		return -1;
	}
	return fd;
}

static void write_stats(const struct agg_switch *sw, const struct service_counters *c,
			const char *path)
{
	static uint64_t seq;    /* tells a reader this write from the one before */
	char extra[256];
	snprintf(extra, sizeof(extra), "\"seq\": %" PRIu64 ", \"service\": {\"rx_datagrams\": %"
		 PRIu64 ", \"tx_datagrams\": %" PRIu64 ", \"tx_errors\": %" PRIu64 "}",
		 ++seq, c->rx_datagrams, c->tx_datagrams, c->tx_errors);
	if (path == NULL) {
		agg_write_stats_json(sw, stdout, extra);
		fflush(stdout);
		return;
	}
	char tmp[4096];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (f == NULL) {
		fprintf(stderr, "thc_udp_service: cannot write %s: %s\n", tmp, strerror(errno));
		return;
	}
	agg_write_stats_json(sw, f, extra);
	fclose(f);
	if (rename(tmp, path) != 0)
		fprintf(stderr, "thc_udp_service: cannot rename %s: %s\n", tmp, strerror(errno));
}

/* The receive side of one burst: each datagram lands 42 bytes into its frame. */
struct inbox {
	uint8_t frames[BURST][AGG_L2L4_LEN + RX_ROOM];
	struct mmsghdr msgs[BURST];
	struct iovec iov[BURST];
	struct sockaddr_in from[BURST];
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control[BURST];
};

static void inbox_arm(struct inbox *in)
{
	for (int i = 0; i < BURST; i++) {
		in->iov[i].iov_base = in->frames[i] + AGG_L2L4_LEN;
		in->iov[i].iov_len = RX_ROOM;
		struct msghdr *m = &in->msgs[i].msg_hdr;
		m->msg_name = &in->from[i];
		m->msg_namelen = sizeof(in->from[i]);
		m->msg_iov = &in->iov[i];
		m->msg_iovlen = 1;
		m->msg_control = in->control[i].buf;
		m->msg_controllen = sizeof(in->control[i].buf);
		m->msg_flags = 0;
	}
}

static uint8_t received_tos(struct msghdr *m)
{
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(m); cm != NULL; cm = CMSG_NXTHDR(m, cm))
		if (cm->cmsg_level == IPPROTO_IP && cm->cmsg_type == IP_TOS)
			return *(uint8_t *)CMSG_DATA(cm);
	return 0;
}

static void serve(int fd, struct agg_switch *sw, const char *stats_path, pid_t parent)
{
	static struct inbox in;
	static struct outbox out;
	struct service_counters c = { 0 };
	const struct agg_emitter em = { .alloc = outbox_alloc, .ctx = &out, .reuse_input = NULL };
	while (!stop_requested) {
		if (parent > 0 && getppid() != parent)
			break;          /* the starting process ended: we were re-parented */
		if (stats_requested) {
			stats_requested = 0;
			write_stats(sw, &c, stats_path);
		}
		inbox_arm(&in);
		/* Blocks for the first datagram only; a signal ends the wait (no SA_RESTART). */
		int n = recvmmsg(fd, in.msgs, BURST, MSG_WAITFORONE, NULL);
		if (n < 0)
			continue;       /* EINTR, the tick: the flags above; else try again */
		for (int i = 0; i < n; i++) {
			struct msghdr *m = &in.msgs[i].msg_hdr;
			c.rx_datagrams++;
			if ((m->msg_flags & MSG_TRUNC) || in.msgs[i].msg_len > MAX_DATAGRAM) {
				sw->g.drop_oversize++;
				continue;
			}
			if (out.count + AGG_MAX_WORKERS + 1 > OUT_FRAMES)
				flush_outbox(fd, &out, &c);
			uint8_t *f = in.frames[i];
			write_ingress_headers(sw, f, in.msgs[i].msg_len, &in.from[i], received_tos(m));
			uint16_t out_port;
			agg_process(sw, 0, f, AGG_L2L4_LEN + in.msgs[i].msg_len, &em, &out_port);
		}
		flush_outbox(fd, &out, &c);
	}
	write_stats(sw, &c, stats_path);
}

static void usage(const char *prog)
{
	fprintf(stderr, "usage: %s --config FILE --bind IP:PORT [--stats FILE] "
		"[--parent PID]\n", prog);
}

int main(int argc, char **argv)
{
	const char *config_path = NULL, *bind_to = NULL, *stats_path = NULL;
	long parent = 0;
	static const struct option opts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "bind", required_argument, NULL, 'b' },
		{ "stats", required_argument, NULL, 's' },
		{ "parent", required_argument, NULL, 'p' },
		{ NULL, 0, NULL, 0 },
	};
	for (int opt; (opt = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
		switch (opt) {
		case 'c': config_path = optarg; break;
		case 'b': bind_to = optarg; break;
		case 's': stats_path = optarg; break;
		case 'p': parent = strtol(optarg, NULL, 10); break;
		default: usage(argv[0]); return 2;
		}
	}
	if (config_path == NULL || bind_to == NULL || optind != argc) {
		usage(argv[0]);
		return 2;
	}
	struct sigaction sa = { .sa_handler = on_signal };     /* no SA_RESTART */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);

	static struct agg_switch sw;
	char err[512];
	if (agg_config_load(&sw, config_path, err, sizeof(err)) < 0) {
		fprintf(stderr, "thc_udp_service: %s\n", err);
		return 1;
	}
	for (uint32_t j = 0; j < sw.num_jobs; j++)
		for (uint32_t w = 0; w < AGG_MAX_WORKERS; w++)
			if (sw.jobs[j].members[w].valid && sw.jobs[j].members[w].port != 0) {
				fprintf(stderr, "thc_udp_service: job %u worker %u is on switch port %u: "
					"the service has one port, 0 (the kernel owns the ports)\n",
					sw.jobs[j].id, w, sw.jobs[j].members[w].port);
				agg_switch_free(&sw);
				return 1;
			}
	struct sockaddr_in addr;
	int fd = open_socket(bind_to, &addr);
	if (fd < 0) {
		agg_switch_free(&sw);
		return 1;
	}
	char host[INET_ADDRSTRLEN];
	inet_ntop(AF_INET, &addr.sin_addr, host, sizeof(host));
	printf("thc_udp_service: serving %s:%u, %u job(s), running\n", host, ntohs(addr.sin_port),
	       sw.num_jobs);
	fflush(stdout);
	serve(fd, &sw, stats_path, (pid_t)parent);
	close(fd);
	agg_switch_free(&sw);
	return 0;
}
