/* SPDX-License-Identifier: BSD-3-Clause
 *
 * thc_switch: the THC-INA aggregation switch on DPDK (docs/protocol.md v1).
 *
 * One lcore runs rx -> process -> DLCP enqueue -> strict-priority tx on every
 * port. Ports are whatever EAL offers: net_pcap (deterministic runs of the packet
 * suite), net_af_packet / net_tap (veth or tap, live), real NICs, net_null (bench).
 *
 *   thc_switch [EAL args] -- --config FILE [--stats FILE] [--rate PORT:PPS]...
 *              [--schedule FILE] [--exit-idle-ms MS]
 *              [--bench PACKETS [--bench-values N] [--forward-only]]
 *
 * --schedule: the order of ingress across ports for pcap runs: one line per packet
 *   with the port to read it from, 'drain' to empty every queue (paused ports
 *   included). At the end of the schedule all queues drain and the switch exits.
 * --rate PORT:PPS: DLCP service rate of a port; 0 = paused until the input is
 *   exhausted (end of schedule, or exit), then drained in strict-priority order.
 * Statistics go to --stats (JSON) on exit and on SIGUSR1; without --stats, to stdout.
 * Stdout otherwise carries the one start-up line ("... running").
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rte_common.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_lpm.h>
#include <rte_mbuf.h>
#include <rte_memcpy.h>

#include "agg_core.h"

#define BURST_SIZE      32
#define NUM_MBUFS       8191
#define MBUF_CACHE      256
#define RX_DESC         1024
#define TX_DESC         1024
#define MAX_EMIT        (AGG_MAX_WORKERS + 1)
#define RATE_UNLIMITED  (-1.0)

static volatile bool force_quit;
static volatile bool dump_stats;

struct port_state {
	struct dlcp_port dlcp;
	double rate;            /* packets/s; RATE_UNLIMITED; 0 = paused */
	double tokens;
	uint64_t last_tsc;
	uint64_t rx, tx, tx_dropped, tx_nombuf;
	/* An unlimited port never holds a backlog: admitted frames go straight to
	 * this burst buffer (arrival order = priority order) and leave at service. */
	struct rte_mbuf *txbuf[BURST_SIZE];
	uint16_t nb_txbuf;
};

struct app {
	struct agg_switch sw;
	struct rte_mempool *pool;
	struct rte_lpm *lpm;
	uint16_t nb_ports;
	struct port_state ports[AGG_MAX_PORTS];
	const char *config_path;
	const char *stats_path;
	const char *schedule_path;
	uint64_t exit_idle_ms;
	uint64_t bench_packets;
	uint32_t bench_values;
	bool forward_only;
	bool input_done;        /* paused ports may drain */
	/* frames the core emitted while processing the current packet */
	struct rte_mbuf *emit_mbuf[MAX_EMIT];
	uint16_t emit_port[MAX_EMIT];
	uint16_t nb_emit;
	struct rte_mbuf *input;      /* the frame being processed */
	bool input_reused;           /* ... now carries an emission: do not free it */
	/* emission mbufs allocated a burst at a time */
	struct rte_mbuf *stash[BURST_SIZE];
	uint16_t nb_stash;
	/* input frames done with, freed in bulk once per burst */
	struct rte_mbuf *consumed[BURST_SIZE];
	uint16_t nb_consumed;
};

static struct app app;

static void signal_handler(int signum)
{
	if (signum == SIGUSR1)
		dump_stats = true;
	else
		force_quit = true;
}

/* ---- statistics ---------------------------------------------------------- */

static void write_stats(struct app *a)
{
	char extra[4096];
	size_t n = (size_t)snprintf(extra, sizeof(extra), "\"ports\": {");
	for (uint16_t p = 0; p < a->nb_ports && n < sizeof(extra); p++) {
		const struct port_state *ps = &a->ports[p];
		n += (size_t)snprintf(extra + n, sizeof(extra) - n,
			"%s\"%u\": {\"rx\": %" PRIu64 ", \"tx\": %" PRIu64 ", \"tx_dropped\": %" PRIu64
			", \"tx_nombuf\": %" PRIu64 ", \"queued\": %u}", p ? ", " : "", p,
			ps->rx, ps->tx, ps->tx_dropped, ps->tx_nombuf, ps->dlcp.queued);
	}
	if (n < sizeof(extra))
		snprintf(extra + n, sizeof(extra) - n, "}");
	/* With a stats file the counters go there only: a long-running switch must
	 * never block on a stdout pipe that nobody reads (issue 11.1). */
	if (a->stats_path == NULL) {
		agg_write_stats_json(&a->sw, stdout, extra);
		fflush(stdout);
		return;
	}
	/* Write-then-rename so a reader never sees half a file. */
	char tmp[4096];
	snprintf(tmp, sizeof(tmp), "%s.tmp", a->stats_path);
	FILE *f = fopen(tmp, "w");
	if (f == NULL) {
		fprintf(stderr, "thc_switch: cannot write %s: %s\n", tmp, strerror(errno));
		return;
	}
	agg_write_stats_json(&a->sw, f, extra);
	fclose(f);
	if (rename(tmp, a->stats_path) != 0)
		fprintf(stderr, "thc_switch: cannot rename %s: %s\n", tmp, strerror(errno));
}

/* ---- emission and egress -------------------------------------------------- */

static uint8_t *emit_alloc(void *ctx, uint16_t port, uint16_t len)
{
	struct app *a = ctx;
	if (a->nb_emit == MAX_EMIT || port >= a->nb_ports)
		return NULL;
	if (a->nb_stash == 0 && rte_pktmbuf_alloc_bulk(a->pool, a->stash, BURST_SIZE) == 0)
		a->nb_stash = BURST_SIZE;
	/* Short of a whole burst, the pool may still have a few. */
	struct rte_mbuf *m = a->nb_stash ? a->stash[--a->nb_stash] : rte_pktmbuf_alloc(a->pool);
	if (m == NULL) {
		a->ports[port].tx_nombuf++;
		return NULL;
	}
	char *data = rte_pktmbuf_append(m, len);
	if (data == NULL) {
		rte_pktmbuf_free(m);
		return NULL;
	}
	a->emit_mbuf[a->nb_emit] = m;
	a->emit_port[a->nb_emit] = port;
	a->nb_emit++;
	return (uint8_t *)data;
}

/* The completing packet's mbuf carries the first copy of a result: only a
 * plain single-segment mbuf that this switch alone holds and that has room. */
static uint8_t *emit_reuse_input(void *ctx, uint16_t port, uint16_t len)
{
	struct app *a = ctx;
	struct rte_mbuf *m = a->input;
	if (m == NULL || a->input_reused || a->nb_emit == MAX_EMIT || port >= a->nb_ports ||
	    !RTE_MBUF_DIRECT(m) || rte_mbuf_refcnt_read(m) != 1 || m->nb_segs != 1 ||
	    len > m->buf_len - m->data_off)
		return NULL;
	m->data_len = len;
	m->pkt_len = len;
	m->ol_flags = 0;        /* rx flags say nothing about the new frame */
	a->input_reused = true;
	a->emit_mbuf[a->nb_emit] = m;
	a->emit_port[a->nb_emit] = port;
	a->nb_emit++;
	return rte_pktmbuf_mtod(m, uint8_t *);
}

static void tx_all(struct app *a, uint16_t port, struct rte_mbuf **pkts, uint16_t n);

static void egress(struct app *a, struct rte_mbuf *m, uint16_t port)
{
	struct port_state *ps = &a->ports[port];
	uint8_t *frame = rte_pktmbuf_mtod(m, uint8_t *);
	if (ps->dlcp.unlimited) {
		if (dlcp_admit(&a->sw, &ps->dlcp, frame, rte_pktmbuf_data_len(m)) < 0) {
			rte_pktmbuf_free(m);
			return;
		}
		ps->txbuf[ps->nb_txbuf++] = m;
		if (ps->nb_txbuf == BURST_SIZE) {
			tx_all(a, port, ps->txbuf, ps->nb_txbuf);
			ps->nb_txbuf = 0;
		}
		return;
	}
	if (!dlcp_enqueue(&a->sw, &ps->dlcp, frame, rte_pktmbuf_data_len(m), m))
		rte_pktmbuf_free(m);
}

static void free_consumed(struct app *a)
{
	if (a->nb_consumed) {
		rte_pktmbuf_free_bulk(a->consumed, a->nb_consumed);
		a->nb_consumed = 0;
	}
}

static void process_packet(struct app *a, struct rte_mbuf *m, uint16_t in_port)
{
	static const struct agg_emitter emitter = {
		emit_alloc, &app, emit_reuse_input,
	};
	uint16_t out_port = 0;

	a->ports[in_port].rx++;
	/* The core sees the first segment only: a chained (jumbo) frame's first
	 * 2 KiB hold every header and any valid aggregation packet whole (at most
	 * 1140 bytes); the rest can only be padding or ordinary traffic, and a
	 * forwarded frame leaves as the whole chain. */
	a->nb_emit = 0;
	a->input = m;
	a->input_reused = false;
	enum agg_verdict v = agg_process(&a->sw, in_port, rte_pktmbuf_mtod(m, uint8_t *),
					 rte_pktmbuf_data_len(m), &emitter, &out_port);
	a->input = NULL;
	for (uint16_t i = 0; i < a->nb_emit; i++)
		egress(a, a->emit_mbuf[i], a->emit_port[i]);
	if (a->input_reused)
		return;
	if (v == AGG_FORWARD && out_port < a->nb_ports) {
		egress(a, m, out_port);
		return;
	}
	a->consumed[a->nb_consumed++] = m;
	if (a->nb_consumed == BURST_SIZE)
		free_consumed(a);
}

/* A burst in order, the next packet's slot prefetched while one is processed
 * (prefetching further ahead measured no better). */
static void process_burst(struct app *a, struct rte_mbuf **pkts, const uint16_t *in_port,
			  uint16_t n)
{
	if (n > 0)
		agg_prefetch(&a->sw, rte_pktmbuf_mtod(pkts[0], uint8_t *), rte_pktmbuf_data_len(pkts[0]));
	for (uint16_t i = 0; i < n; i++) {
		if (i + 1 < n)
			agg_prefetch(&a->sw, rte_pktmbuf_mtod(pkts[i + 1], uint8_t *),
				     rte_pktmbuf_data_len(pkts[i + 1]));
		process_packet(a, pkts[i], in_port[i]);
	}
}

static void tx_all(struct app *a, uint16_t port, struct rte_mbuf **pkts, uint16_t n)
{
	uint16_t sent = 0;
	for (int tries = 0; sent < n && tries < 16; tries++)
		sent += rte_eth_tx_burst(port, 0, pkts + sent, n - sent);
	a->ports[port].tx += sent;
	if (sent < n) {
		a->ports[port].tx_dropped += n - sent;
		rte_pktmbuf_free_bulk(pkts + sent, n - sent);
	}
}

/* Send up to budget packets of a port in strict-priority order. */
static void drain_port(struct app *a, uint16_t port, uint64_t budget)
{
	struct rte_mbuf *pkts[BURST_SIZE];
	while (budget > 0) {
		uint16_t n = 0;
		while (n < BURST_SIZE && n < budget) {
			struct rte_mbuf *m = dlcp_dequeue(&a->ports[port].dlcp);
			if (m == NULL)
				break;
			pkts[n++] = m;
		}
		if (n == 0)
			return;
		tx_all(a, port, pkts, n);
		budget -= n;
	}
}

/* Send what the aggregation path buffered for port p (unlimited-rate results). */
static inline void flush_txbuf(struct app *a, uint16_t p)
{
	struct port_state *ps = &a->ports[p];
	if (ps->nb_txbuf) {
		tx_all(a, p, ps->txbuf, ps->nb_txbuf);
		ps->nb_txbuf = 0;
	}
}

/* The DLCP service of every port: unlimited ports empty their queues, rated
 * ports send what their token bucket allows, paused ports wait for input_done. */
static void service_ports(struct app *a)
{
	uint64_t now = rte_rdtsc();
	free_consumed(a);
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		struct port_state *ps = &a->ports[p];
		flush_txbuf(a, p);
		if (ps->dlcp.queued == 0) {
			ps->last_tsc = now;
			continue;
		}
		if (ps->rate < 0 || (ps->rate == 0 && a->input_done)) {
			drain_port(a, p, UINT64_MAX);
			continue;
		}
		if (ps->rate == 0)
			continue;
		ps->tokens += (double)(now - ps->last_tsc) * ps->rate / (double)rte_get_tsc_hz();
		ps->last_tsc = now;
		if (ps->tokens > BURST_SIZE)
			ps->tokens = BURST_SIZE;
		if (ps->tokens >= 1) {
			uint64_t n = (uint64_t)ps->tokens;
			ps->tokens -= (double)n;
			drain_port(a, p, n);
		}
	}
}

static void drain_all(struct app *a)
{
	free_consumed(a);
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		flush_txbuf(a, p);
		drain_port(a, p, UINT64_MAX);
	}
}

/* ---- run modes ----------------------------------------------------------- */

/* Live: poll every port until SIGINT/SIGTERM (or --exit-idle-ms of silence). */
static void main_loop(struct app *a)
{
	struct rte_mbuf *pkts[BURST_SIZE];
	uint16_t in_port[BURST_SIZE];
	uint64_t hz = rte_get_tsc_hz(), last_rx = rte_rdtsc();

	while (!force_quit) {
		uint64_t got = 0;
		for (uint16_t p = 0; p < a->nb_ports; p++) {
			uint16_t n = rte_eth_rx_burst(p, 0, pkts, BURST_SIZE);
			for (uint16_t i = 0; i < n; i++)
				in_port[i] = p;
			process_burst(a, pkts, in_port, n);
			got += n;
		}
		service_ports(a);
		if (dump_stats) {
			dump_stats = false;
			write_stats(a);
		}
		uint64_t now = rte_rdtsc();
		if (got)
			last_rx = now;
		else if (a->exit_idle_ms && now - last_rx > a->exit_idle_ms * hz / 1000)
			break;
	}
	a->input_done = true;
	drain_all(a);
}

/* Deterministic: read packets in the scheduled cross-port order, one at a time. */
static int schedule_loop(struct app *a)
{
	FILE *f = fopen(a->schedule_path, "r");
	char line[64];
	int lineno = 0;
	if (f == NULL) {
		fprintf(stderr, "thc_switch: cannot open schedule %s: %s\n", a->schedule_path,
			strerror(errno));
		return -1;
	}
	while (!force_quit && fgets(line, sizeof(line), f) != NULL) {
		lineno++;
		if (!strncmp(line, "drain", 5)) {
			drain_all(a);
			continue;
		}
		char *end;
		unsigned long p = strtoul(line, &end, 10);
		if (end == line || p >= a->nb_ports) {
			fprintf(stderr, "thc_switch: schedule line %d: '%s' is not a port (0..%u) or 'drain'\n",
				lineno, line, a->nb_ports - 1);
			fclose(f);
			return -1;
		}
		struct rte_mbuf *m;
		uint16_t n = 0;
		for (int tries = 0; n == 0 && tries < 1000; tries++)
			n = rte_eth_rx_burst((uint16_t)p, 0, &m, 1);
		if (n == 0) {
			fprintf(stderr, "thc_switch: schedule line %d: port %lu has no more input\n",
				lineno, p);
			fclose(f);
			return -1;
		}
		process_packet(a, m, (uint16_t)p);
		service_ports(a);
		if (dump_stats) {
			dump_stats = false;
			write_stats(a);
		}
	}
	fclose(f);
	a->input_done = true;
	drain_all(a);
	return 0;
}

/* ---- benchmark: in-memory generator, no pcap I/O ---------------------------- */

struct bench_template {
	uint8_t frame[AGG_MIN_FRAME + AGG_MAX_VALUES / 2];
	uint16_t len;
	uint16_t port;
};

static void build_bench_template(struct app *a, const struct agg_job *job, uint32_t w,
				 struct bench_template *t)
{
	const struct agg_member *m = &job->members[w];
	uint32_t nv = a->bench_values, payload = (nv + 1) / 2;
	uint8_t *f = t->frame, *ip = f + 14, *udp = ip + 20, *h = udp + 8;
	memset(f, 0, sizeof(t->frame));
	memcpy(f, a->sw.mac, 6);
	memcpy(f + 6, m->mac, 6);
	f[12] = 0x08;
	ip[0] = 0x45;
	ip[1] = (32 << 2) | 2;     /* data band 0, ECT(0) */
	ip[2] = (uint8_t)((20 + 8 + 32 + payload) >> 8);
	ip[3] = (uint8_t)(20 + 8 + 32 + payload);
	ip[8] = 64;
	ip[9] = 17;
	udp[0] = (uint8_t)(m->udp_port >> 8); udp[1] = (uint8_t)m->udp_port;
	udp[2] = (uint8_t)(AGG_PORT_BASE >> 8); udp[3] = (uint8_t)AGG_PORT_BASE;
	udp[4] = (uint8_t)((8 + 32 + payload) >> 8); udp[5] = (uint8_t)(8 + 32 + payload);
	h[0] = AGG_VERSION << 4 | AGG_TYPE_DATA;
	h[2] = (uint8_t)(job->id >> 8); h[3] = (uint8_t)job->id;
	h[6] = (uint8_t)w;
	uint32_t expected = 0;
	for (uint32_t i = 0; i < AGG_MAX_WORKERS; i++)
		if (job->members[i].valid)
			expected |= 1u << i;
	h[12] = expected >> 24; h[13] = expected >> 16; h[14] = expected >> 8; h[15] = expected;
	h[28] = (uint8_t)(nv >> 8); h[29] = (uint8_t)nv;
	for (uint32_t i = 0; i < payload; i++)
		h[32 + i] = (uint8_t)(rte_rand() & (nv % 2 && i == payload - 1 ? 0xf0 : 0xff));
	t->len = (uint16_t)(AGG_MIN_FRAME + payload);
	t->port = m->port;
}

/* The plain forwarder the benchmark compares against: l2fwd's MAC rewrite and
 * a burst transmit per port, no aggregation, no DLCP. */
static void forward_plain(struct app *a, struct rte_mbuf **pkts, const uint16_t *in_port,
			  uint16_t n)
{
	struct rte_mbuf *out[AGG_MAX_PORTS][BURST_SIZE];
	uint16_t nb_out[AGG_MAX_PORTS] = { 0 };
	for (uint16_t i = 0; i < n; i++) {
		uint8_t *f = rte_pktmbuf_mtod(pkts[i], uint8_t *);
		memcpy(f, f + 6, 6);
		memcpy(f + 6, a->sw.mac, 6);
		a->ports[in_port[i]].rx++;
		out[in_port[i]][nb_out[in_port[i]]++] = pkts[i];
	}
	for (uint16_t p = 0; p < a->nb_ports; p++)
		if (nb_out[p])
			tx_all(a, p, out[p], nb_out[p]);
}

/* Worker w's packet k of the stream: slots in turn, each slot's round advancing
 * only after every member contributed (the window rule of §4.4). */
static int bench_loop(struct app *a)
{
	if (a->sw.num_jobs == 0) {
		fprintf(stderr, "thc_switch: --bench needs a job in the config\n");
		return -1;
	}
	const struct agg_job *job = &a->sw.jobs[0];
	struct bench_template tmpl[AGG_MAX_WORKERS];
	uint32_t nw = 0;
	for (uint32_t w = 0; w < AGG_MAX_WORKERS; w++)
		if (job->members[w].valid)
			build_bench_template(a, job, w, &tmpl[nw++]);
	struct rte_mbuf *pkts[BURST_SIZE];
	uint64_t done = 0, k = 0, results_before = job->c.results_multicast;
	/* CPU time of this thread as well as wall time: on a shared machine the
	 * wall clock also counts the time other processes had the core. */
	struct timespec cpu0, cpu1;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
	uint64_t start = rte_rdtsc();
	while (done < a->bench_packets && !force_quit) {
		uint16_t n = (uint16_t)RTE_MIN((uint64_t)BURST_SIZE, a->bench_packets - done);
		if (rte_pktmbuf_alloc_bulk(a->pool, pkts, n) != 0) {
			service_ports(a);
			continue;
		}
		/* Generator (the "NIC"): copy a template, patch slot and round. */
		uint16_t in_port[BURST_SIZE];
		for (uint16_t i = 0; i < n; i++, k++) {
			uint64_t chunk = k / nw;
			const struct bench_template *t = &tmpl[k % nw];
			uint8_t *f = (uint8_t *)rte_pktmbuf_append(pkts[i], t->len);
			memcpy(f, t->frame, t->len);
			uint32_t slot = (uint32_t)(chunk % job->pool_size);
			uint32_t round = (uint32_t)(chunk / job->pool_size);
			uint8_t *h = f + AGG_L2L4_LEN;
			h[4] = (uint8_t)(slot >> 8); h[5] = (uint8_t)slot;
			h[8] = round >> 24; h[9] = round >> 16; h[10] = round >> 8; h[11] = (uint8_t)round;
			in_port[i] = t->port;
		}
		if (a->forward_only)
			forward_plain(a, pkts, in_port, n);
		else
			process_burst(a, pkts, in_port, n);
		service_ports(a);
		done += n;
	}
	a->input_done = true;
	drain_all(a);
	uint64_t cycles = rte_rdtsc() - start;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
	double wall = (double)cycles / (double)rte_get_tsc_hz();
	double secs = (double)(cpu1.tv_sec - cpu0.tv_sec) + (double)(cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
	uint64_t aggregated = job->c.aggregated;
	printf("BENCH {\"mode\": \"%s\", \"packets\": %" PRIu64 ", \"workers\": %u, "
	       "\"values_per_packet\": %u, \"wall_seconds\": %.6f, \"cpu_seconds\": %.6f, \"packets_per_s\": %.1f, "
	       "\"values_per_s\": %.1f, \"results\": %" PRIu64 "}\n",
	       a->forward_only ? "forward" : "aggregate", done, nw, a->bench_values, wall, secs,
	       (double)done / secs,
	       a->forward_only ? (double)done * a->bench_values / secs
			       : (double)aggregated * a->bench_values / secs,
	       job->c.results_multicast - results_before);
	return 0;
}

/* ---- initialisation ------------------------------------------------------ */

static int lpm_lookup(void *ctx, uint32_t dst_ip)
{
	uint32_t next_hop;
	return rte_lpm_lookup((struct rte_lpm *)ctx, dst_ip, &next_hop) == 0 ? (int)next_hop : -1;
}

static int setup_lpm(struct app *a)
{
	if (a->sw.num_routes == 0)
		return 0;
	struct rte_lpm_config cfg = { .max_rules = a->sw.num_routes + 1, .number_tbl8s = 256 };
	a->lpm = rte_lpm_create("routes", (int)rte_socket_id(), &cfg);
	if (a->lpm == NULL)
		return -1;
	for (uint32_t i = 0; i < a->sw.num_routes; i++)
		if (rte_lpm_add(a->lpm, a->sw.routes[i].prefix, a->sw.routes[i].depth, i) != 0)
			return -1;
	a->sw.route_lookup = lpm_lookup;
	a->sw.route_ctx = a->lpm;
	return 0;
}

static int port_init(struct app *a, uint16_t port)
{
	struct rte_eth_conf conf;
	struct rte_eth_dev_info info;
	uint16_t nb_rxd = RX_DESC, nb_txd = TX_DESC;
	int rc;

	memset(&conf, 0, sizeof(conf));
	if ((rc = rte_eth_dev_info_get(port, &info)) != 0)
		return rc;
	/* A chained (jumbo) frame that is forwarded leaves as the whole chain. */
	if (info.tx_offload_capa & RTE_ETH_TX_OFFLOAD_MULTI_SEGS)
		conf.txmode.offloads |= RTE_ETH_TX_OFFLOAD_MULTI_SEGS;
	if ((rc = rte_eth_dev_configure(port, 1, 1, &conf)) != 0)
		return rc;
	if ((rc = rte_eth_dev_adjust_nb_rx_tx_desc(port, &nb_rxd, &nb_txd)) != 0)
		return rc;
	rc = rte_eth_rx_queue_setup(port, 0, nb_rxd, rte_eth_dev_socket_id(port), NULL, a->pool);
	if (rc < 0)
		return rc;
	rc = rte_eth_tx_queue_setup(port, 0, nb_txd, rte_eth_dev_socket_id(port), NULL);
	if (rc < 0)
		return rc;
	if ((rc = rte_eth_dev_start(port)) < 0)
		return rc;
	rte_eth_promiscuous_enable(port);   /* not every PMD supports it; fine */
	return 0;
}

static void usage(const char *prog)
{
	fprintf(stderr,
		"usage: %s [EAL options] -- --config FILE [--stats FILE] [--rate PORT:PPS]...\n"
		"       [--schedule FILE] [--exit-idle-ms MS]\n"
		"       [--bench PACKETS [--bench-values N] [--forward-only]]\n", prog);
}

static int parse_args(struct app *a, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "stats", required_argument, NULL, 's' },
		{ "rate", required_argument, NULL, 'r' },
		{ "schedule", required_argument, NULL, 'S' },
		{ "exit-idle-ms", required_argument, NULL, 'i' },
		{ "bench", required_argument, NULL, 'b' },
		{ "bench-values", required_argument, NULL, 'v' },
		{ "forward-only", no_argument, NULL, 'f' },
		{ NULL, 0, NULL, 0 },
	};
	int opt;
	for (int p = 0; p < (int)AGG_MAX_PORTS; p++)
		a->ports[p].rate = RATE_UNLIMITED;
	a->bench_values = AGG_MAX_VALUES;
	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (opt) {
		case 'c': a->config_path = optarg; break;
		case 's': a->stats_path = optarg; break;
		case 'S': a->schedule_path = optarg; break;
		case 'i': a->exit_idle_ms = strtoull(optarg, NULL, 10); break;
		case 'b': a->bench_packets = strtoull(optarg, NULL, 10); break;
		case 'f': a->forward_only = true; break;
		case 'v':
			a->bench_values = (uint32_t)strtoul(optarg, NULL, 10);
			if (a->bench_values < 1 || a->bench_values > AGG_MAX_VALUES) {
				fprintf(stderr, "--bench-values must be in 1..%u\n", AGG_MAX_VALUES);
				return -1;
			}
			break;
		case 'r': {
			unsigned port;
			double pps;
			if (sscanf(optarg, "%u:%lf", &port, &pps) != 2 || port >= AGG_MAX_PORTS || pps < 0) {
				fprintf(stderr, "--rate expects PORT:PPS (port < %u, pps >= 0), got '%s'\n",
					AGG_MAX_PORTS, optarg);
				return -1;
			}
			a->ports[port].rate = pps;
			break;
		}
		default:
			usage(argv[0]);
			return -1;
		}
	}
	if (a->config_path == NULL) {
		usage(argv[0]);
		fprintf(stderr, "--config is required\n");
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct app *a = &app;
	char err[512];
	int rc = 0;

	/* Before EAL init, so an early SIGUSR1 asks for stats instead of killing us. */
	signal(SIGINT, signal_handler);
	signal(SIGTERM, signal_handler);
	signal(SIGUSR1, signal_handler);

	int consumed = rte_eal_init(argc, argv);
	if (consumed < 0)
		rte_exit(EXIT_FAILURE, "EAL initialisation failed: %s\n", rte_strerror(rte_errno));
	argc -= consumed;
	argv += consumed;
	if (parse_args(a, argc, argv) < 0)
		rte_exit(EXIT_FAILURE, "bad arguments\n");

	if (agg_config_load(&a->sw, a->config_path, err, sizeof(err)) < 0) {
		fprintf(stderr, "thc_switch: refusing configuration %s: %s\n", a->config_path, err);
		rte_eal_cleanup();
		return 2;
	}
	a->nb_ports = rte_eth_dev_count_avail();
	if (a->nb_ports == 0 || a->nb_ports > AGG_MAX_PORTS)
		rte_exit(EXIT_FAILURE, "need 1..%u ports (add --vdev net_pcap0,... or net_null0), have %u\n",
			 AGG_MAX_PORTS, a->nb_ports);
	if (a->sw.max_port >= a->nb_ports) {
		fprintf(stderr, "thc_switch: refusing configuration %s: it uses switch port %u but "
			"only %u ports exist; add a --vdev per port or lower the port numbers\n",
			a->config_path, a->sw.max_port, a->nb_ports);
		rte_eal_cleanup();
		return 2;
	}

	a->pool = rte_pktmbuf_pool_create("mbufs", NUM_MBUFS, MBUF_CACHE, 0,
					  RTE_MBUF_DEFAULT_BUF_SIZE, rte_socket_id());
	if (a->pool == NULL)
		rte_exit(EXIT_FAILURE, "cannot create the mbuf pool (try -m 512)\n");
	if (setup_lpm(a) < 0)
		rte_exit(EXIT_FAILURE, "cannot build the route table\n");
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		/* Unlimited ports admit without backlog, yet a stalled NIC can leave up to
		 * a burst's worth of emissions queued between services. */
		int unlimited = a->ports[p].rate < 0;
		uint32_t ring = unlimited ? RTE_MAX(a->sw.dlcp.capacity, (uint32_t)(BURST_SIZE * MAX_EMIT))
					  : a->sw.dlcp.capacity;
		if (dlcp_port_init(&a->ports[p].dlcp, ring, unlimited) < 0)
			rte_exit(EXIT_FAILURE, "out of memory for DLCP queues\n");
		if ((rc = port_init(a, p)) != 0)
			rte_exit(EXIT_FAILURE, "cannot start port %u: %s\n", p, rte_strerror(-rc));
		a->ports[p].last_tsc = rte_rdtsc();
	}

	printf("thc_switch: %u ports, %u jobs, %u routes: running\n", a->nb_ports, a->sw.num_jobs,
	       a->sw.num_routes);
	fflush(stdout);
	if (a->bench_packets)
		rc = bench_loop(a);
	else if (a->schedule_path)
		rc = schedule_loop(a);
	else
		main_loop(a);

	write_stats(a);
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		struct rte_mbuf *m;
		while ((m = dlcp_dequeue(&a->ports[p].dlcp)) != NULL)
			rte_pktmbuf_free(m);
		dlcp_port_free(&a->ports[p].dlcp);
		rte_eth_dev_stop(p);
		rte_eth_dev_close(p);
	}
	if (a->lpm)
		rte_lpm_free(a->lpm);
	rte_pktmbuf_free_bulk(a->stash, a->nb_stash);
	agg_switch_free(&a->sw);
	rte_eal_cleanup();
	return rc == 0 ? 0 : 1;
}
