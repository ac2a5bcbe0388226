/* SPDX-License-Identifier: BSD-3-Clause
 *
 * thc_switch: the THC-INA aggregation switch on DPDK (docs/protocol.md v1).
 *
 * One lcore runs rx -> process -> DLCP enqueue -> strict-priority tx on every
 * port. Ports are whatever EAL offers: net_pcap (deterministic runs of the packet
 * suite), net_af_packet / net_tap (veth or tap, live), real NICs, net_null (bench).
 *
 *   thc_switch [EAL args] -- --config FILE [--stats FILE] [--rate PORT:PPS]...
 *              [--schedule FILE] [--exit-idle-ms MS] [--busy-poll] [--idle-sleep-max-us US]
 *              [--bench PACKETS [--bench-values N] [--forward-only] [--bench-gap-us US]]
 *
 * --schedule: the order of ingress across ports for pcap runs: one line per packet
 *   with the port to read it from, 'drain' to empty every queue (paused ports
 *   included). At the end of the schedule all queues drain and the switch exits.
 * --rate PORT:PPS: DLCP service rate of a port; 0 = paused until the input is
 *   exhausted (end of schedule, or exit), then drained in strict-priority order.
 * Live polling is adaptive: after IDLE_SPIN_US without work the loop sleeps. When
 *   every port has a descriptor that turns readable with a frame (af_packet
 *   sockets, tap queues) it sleeps in poll() on them, so the first frame wakes it;
 *   otherwise in timed sleeps, 1 us at first and twice as long
 *   after each empty poll up to --idle-sleep-max-us (default 500). --busy-poll
 *   keeps the classic DPDK loop that never sleeps.
 * --bench: an in-memory generator stands in for port 0's rx inside the same poll
 *   loop; --bench-gap-us offers one burst per gap of idle time and reports how
 *   long each waited to be picked up (the cost of the back-off).
 * Frames: up to MAX_FRAME bytes pass whole; what a port cannot receive whole (or is
 *   longer) is dropped and counted rx_oversize, what it cannot send tx_oversize.
 * Statistics go to --stats (JSON) on exit and on SIGUSR1; without --stats, to stdout.
 * Stdout otherwise carries the one start-up line ("... running").
 */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <rte_bus.h>
#include <rte_common.h>
#include <rte_cycles.h>
#include <rte_dev.h>
#include <rte_devargs.h>
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_kvargs.h>
#include <rte_lcore.h>
#include <rte_lpm.h>
#include <rte_mbuf.h>
#include <rte_mbuf_pool_ops.h>
#include <rte_memcpy.h>
#include <rte_pause.h>

#include "af_packet_sockets.h"
#include "agg_core.h"

#define BURST_SIZE      32
#define MBUF_CACHE      256
#define RX_DESC         1024
#define TX_DESC         1024
#define MAX_EMIT        (AGG_MAX_WORKERS + 1)
#define RATE_UNLIMITED  (-1.0)

/* The longest frame the switch receives or sends: a 9000-byte MTU plus Ethernet
 * and VLAN headers, with room (protocol v2, R7: an 8192-value RESULT is 8266 bytes). */
#define MAX_FRAME       9216u
/* Data room of every mbuf after its headroom: one segment holds any frame the
 * switch accepts, so the core always sees a whole frame. It also fits an
 * af_packet ring frame of up to 10272 bytes (framesz), which that PMD requires. */
#define MBUF_ROOM       10240u
/* af_packet (TPACKET_V2) puts an Ethernet frame 66 bytes into a ring frame of
 * framesz bytes and cuts what does not fit without saying so: only frames
 * shorter than framesz - 66 are known to be whole. It sends up to framesz - 32. */
#define AF_PACKET_RX_HEADROOM   66u
#define AF_PACKET_TX_HEADROOM   32u
#define AF_PACKET_FRAMESZ       2048u   /* the PMD's default */

/* Adaptive polling: full speed this long after the last work, then sleep. A
 * wake-up costs ~20 us of CPU on a VM, so timed sleeps grow from
 * IDLE_SLEEP_MIN_US to the bound (--idle-sleep-max-us): 500 us keeps an idle
 * switch near 4% of a core; poll() on the ports' descriptors is woken by the
 * frame itself and times out after IDLE_POLL_TIMEOUT_MS. */
#define IDLE_SPIN_US            100u
#define IDLE_SLEEP_MIN_US       1u
#define IDLE_SLEEP_MAX_US       500u
#define IDLE_POLL_TIMEOUT_MS    100
/* Timer slack of the polling thread: the kernel may otherwise stretch every
 * sleep by its default 50 us. */
#define IDLE_TIMER_SLACK_NS     1000ul

static volatile bool force_quit;
static volatile bool dump_stats;

struct port_state {
	struct dlcp_port dlcp;
	double rate;            /* packets/s; RATE_UNLIMITED; 0 = paused */
	double tokens;
	uint64_t last_tsc;
	uint64_t rx, tx, tx_dropped, tx_nombuf, rx_oversize, tx_oversize;
	uint32_t rx_max;        /* longest frame this port delivers known whole */
	uint32_t tx_max;        /* longest frame this port can send */
	uint16_t nb_rxd, nb_txd;
	uint32_t ring_mbufs;    /* mbufs the PMD may keep in its rx and tx rings */
	uint32_t if_index;      /* kernel interface of an af_packet port */
	bool is_af_packet;
	bool is_tap;
	/* An unlimited port never holds a backlog: admitted frames go straight to
	 * this burst buffer (arrival order = priority order) and leave at service. */
	struct rte_mbuf *txbuf[BURST_SIZE];
	uint16_t nb_txbuf;
};

struct bench_template {
	uint8_t frame[AGG_MIN_FRAME + AGG_MAX_VALUES / 2];
	uint16_t len;
	uint16_t port;
};

/* --bench: the generator that stands in for port 0's rx. */
struct bench_state {
	const struct agg_job *job;
	struct bench_template tmpl[AGG_MAX_WORKERS];
	uint32_t nw;
	uint64_t generated;
	uint64_t gap_tsc;       /* --bench-gap-us: one burst per gap of idle; 0 = back to back */
	uint64_t next_tsc;      /* when the next burst is offered */
	uint64_t *waits;        /* per burst: offered -> picked up, in TSC cycles */
	uint64_t nb_waits, max_waits;
};

/* Adaptive polling state of the live loop. */
struct idle_backoff {
	uint64_t spin_tsc;      /* full-speed polling this long after the last work */
	uint64_t last_work;     /* TSC of the last poll that found work */
	uint32_t sleep_us;      /* the next sleep; 0 = not sleeping yet */
	uint32_t max_us;
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
	uint32_t bench_gap_us;
	bool forward_only;
	bool busy_poll;
	uint32_t idle_sleep_max_us;
	/* When every port has one: the descriptors that wake a sleeping loop. */
	struct pollfd wake[AGG_MAX_PORTS];
	uint16_t nb_wake;
	bool input_done;        /* paused ports may drain */
	struct bench_state bench;
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
	static char extra[AGG_MAX_PORTS * 320 + 64];
	static uint64_t seq;    /* tells a reader this write from the one before */
	size_t n = (size_t)snprintf(extra, sizeof(extra), "\"seq\": %" PRIu64 ", \"ports\": {", ++seq);
	for (uint16_t p = 0; p < a->nb_ports && n < sizeof(extra); p++) {
		const struct port_state *ps = &a->ports[p];
		struct rte_eth_stats es;
		if (rte_eth_stats_get(p, &es) != 0)
			memset(&es, 0, sizeof(es));
		n += (size_t)snprintf(extra + n, sizeof(extra) - n,
			"%s\"%u\": {\"rx\": %" PRIu64 ", \"tx\": %" PRIu64 ", \"tx_dropped\": %" PRIu64
			", \"tx_nombuf\": %" PRIu64 ", \"queued\": %u, \"rx_oversize\": %" PRIu64
			", \"tx_oversize\": %" PRIu64 ", \"rx_missed\": %" PRIu64 ", \"rx_errors\": %" PRIu64
			", \"rx_nombuf\": %" PRIu64 ", \"rx_max\": %u, \"tx_max\": %u}", p ? ", " : "", p,
			ps->rx, ps->tx, ps->tx_dropped, ps->tx_nombuf, ps->dlcp.queued, ps->rx_oversize,
			ps->tx_oversize, es.imissed, es.ierrors, es.rx_nombuf, ps->rx_max, ps->tx_max);
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
	if (data == NULL) {            /* longer than an mbuf holds: counted, never cut */
		a->ports[port].tx_oversize++;
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
	/* Handed to the PMD it would vanish uncounted (af_packet) or stall the
	 * rest of its burst (tap). */
	if (unlikely(rte_pktmbuf_pkt_len(m) > ps->tx_max)) {
		ps->tx_oversize++;
		rte_pktmbuf_free(m);
		return;
	}
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
	/* Every frame here is one segment (rx_fits): the core sees all of it. */
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

/* ---- receive ----------------------------------------------------------------- */

/* Whether a received frame may go on: one the port may have cut (or that is
 * longer than the switch handles) is dropped and counted, never forwarded cut. A
 * frame of at most rx_max bytes is one segment (MBUF_ROOM). */
static inline bool rx_fits(struct port_state *ps, struct rte_mbuf *m)
{
	if (likely(rte_pktmbuf_pkt_len(m) <= ps->rx_max))
		return true;
	ps->rx_oversize++;
	rte_pktmbuf_free(m);
	return false;
}

static uint16_t rx_port(struct app *a, uint16_t p, struct rte_mbuf **pkts, uint16_t *in_port)
{
	struct port_state *ps = &a->ports[p];
	uint16_t n = rte_eth_rx_burst(p, 0, pkts, BURST_SIZE), kept = 0;
	for (uint16_t i = 0; i < n; i++) {
		if (!rx_fits(ps, pkts[i]))
			continue;
		pkts[kept] = pkts[i];
		in_port[kept++] = p;
	}
	return kept;
}

/* ---- benchmark generator --------------------------------------------------- */

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
	for (int i = 0; i < 4; i++) {      /* the member's and the switch's addresses */
		ip[12 + i] = (uint8_t)(m->ip >> (24 - 8 * i));
		ip[16 + i] = (uint8_t)(a->sw.ip >> (24 - 8 * i));
	}
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

static int bench_setup(struct app *a)
{
	struct bench_state *b = &a->bench;
	if (a->sw.num_jobs == 0) {
		fprintf(stderr, "thc_switch: --bench needs a job in the config\n");
		return -1;
	}
	b->job = &a->sw.jobs[0];
	/* Values per packet: the job's size unless --bench-values asks for fewer (a longer
	 * DATA would only be counted drop_bad_length). */
	if (a->bench_values == 0)
		a->bench_values = b->job->values_per_packet;
	if (a->bench_values > b->job->values_per_packet) {
		fprintf(stderr, "thc_switch: --bench-values %u exceeds job %u's values_per_packet "
			"%u: lower --bench-values or raise values_per_packet\n", a->bench_values,
			b->job->id, b->job->values_per_packet);
		return -1;
	}
	for (uint32_t w = 0; w < AGG_MAX_WORKERS; w++)
		if (b->job->members[w].valid)
			build_bench_template(a, b->job, w, &b->tmpl[b->nw++]);
	if (a->bench_gap_us) {
		b->gap_tsc = (uint64_t)a->bench_gap_us * rte_get_tsc_hz() / 1000000;
		b->max_waits = a->bench_packets / BURST_SIZE + 1;
		b->waits = calloc(b->max_waits, sizeof(*b->waits));
		if (b->waits == NULL)
			return -1;
	}
	return 0;
}

static inline bool bench_done(const struct app *a)
{
	return a->bench_packets && a->bench.generated >= a->bench_packets;
}

/* Worker w's packet k of the stream: slots in turn, each slot's round advancing
 * only after every member contributed (the window rule of §4.4). Frames come in
 * bursts as from a NIC (mbufs from the pool, a template copied, slot and round
 * patched), all on "port 0": each carries its member's port as its in_port. */
static uint16_t bench_rx(struct app *a, uint16_t p, struct rte_mbuf **pkts, uint16_t *in_port)
{
	struct bench_state *b = &a->bench;
	if (p != 0 || bench_done(a))
		return 0;
	uint64_t now = 0;
	if (b->gap_tsc) {
		now = rte_rdtsc();
		if (now < b->next_tsc)
			return 0;
	}
	uint16_t n = (uint16_t)RTE_MIN((uint64_t)BURST_SIZE, a->bench_packets - b->generated);
	if (rte_pktmbuf_alloc_bulk(a->pool, pkts, n) != 0)
		return 0;
	if (b->gap_tsc) {
		/* How late the poll loop picked this burst up; the next one comes a
		 * whole gap of idle time later. */
		if (b->next_tsc && b->nb_waits < b->max_waits)
			b->waits[b->nb_waits++] = now - b->next_tsc;
		b->next_tsc = now + b->gap_tsc;
	}
	const struct agg_job *job = b->job;
	for (uint16_t i = 0; i < n; i++, b->generated++) {
		uint64_t chunk = b->generated / b->nw;
		const struct bench_template *t = &b->tmpl[b->generated % b->nw];
		uint8_t *f = (uint8_t *)rte_pktmbuf_append(pkts[i], t->len);
		memcpy(f, t->frame, t->len);
		uint32_t slot = (uint32_t)(chunk % job->pool_size);
		uint32_t round = (uint32_t)(chunk / job->pool_size);
		uint8_t *h = f + AGG_L2L4_LEN;
		h[4] = (uint8_t)(slot >> 8); h[5] = (uint8_t)slot;
		h[8] = round >> 24; h[9] = round >> 16; h[10] = round >> 8; h[11] = (uint8_t)round;
		in_port[i] = t->port;
	}
	return n;
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

/* ---- run modes ----------------------------------------------------------- */

static inline uint16_t poll_port(struct app *a, uint16_t p, struct rte_mbuf **pkts,
				 uint16_t *in_port)
{
	if (unlikely(a->bench_packets))
		return bench_rx(a, p, pkts, in_port);
	return rx_port(a, p, pkts, in_port);
}

/* A rated port with a backlog needs its token bucket served: no sleeping. */
static bool rated_backlog(const struct app *a)
{
	for (uint16_t p = 0; p < a->nb_ports; p++)
		if (a->ports[p].rate > 0 && a->ports[p].dlcp.queued)
			return true;
	return false;
}

/* Adaptive polling (DPDK's power-aware examples do the like): nothing to do for
 * spin_tsc, then sleep until a frame arrives (poll() on the af_packet sockets)
 * or, where the ports offer nothing to sleep on, for growing periods: twice as
 * long after each further empty poll, up to max_us. The first poll that finds
 * work is back at full speed. A signal ends any sleep early. */
static void back_off(struct app *a, struct idle_backoff *b, bool worked, uint64_t now)
{
	if (worked) {
		b->last_work = now;
		b->sleep_us = 0;
		return;
	}
	if (now - b->last_work < b->spin_tsc) {
		rte_pause();
		return;
	}
	if (a->nb_wake) {
		poll(a->wake, a->nb_wake, IDLE_POLL_TIMEOUT_MS);
		return;
	}
	b->sleep_us = b->sleep_us ? RTE_MIN(2 * b->sleep_us, b->max_us) : IDLE_SLEEP_MIN_US;
	struct timespec ts = { .tv_sec = b->sleep_us / 1000000,
			       .tv_nsec = (long)(b->sleep_us % 1000000) * 1000 };
	nanosleep(&ts, NULL);
}

/* The descriptors to sleep on, when every port has one (and not for the
 * benchmark, whose input is the generator). */
static void setup_wakeup(struct app *a)
{
	a->nb_wake = 0;
	if (a->bench_packets)
		return;
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		const struct port_state *ps = &a->ports[p];
		int fd = ps->is_af_packet ? thc_af_packet_fd((int)ps->if_index) :
			 ps->is_tap ? rte_eth_dev_rx_intr_ctl_q_get_fd(p, 0) : -1;
		if (fd < 0) {
			a->nb_wake = 0;
			return;
		}
		a->wake[a->nb_wake++] = (struct pollfd){ .fd = fd, .events = POLLIN };
	}
}

/* Live (and --bench): poll every port until SIGINT/SIGTERM, --exit-idle-ms of
 * silence or the end of the benchmark. */
static void main_loop(struct app *a)
{
	struct rte_mbuf *pkts[BURST_SIZE];
	uint16_t in_port[BURST_SIZE];
	uint64_t hz = rte_get_tsc_hz(), last_rx = rte_rdtsc();
	struct idle_backoff idle = {
		.spin_tsc = IDLE_SPIN_US * hz / 1000000, .last_work = last_rx,
		.max_us = a->idle_sleep_max_us,
	};
	if (!a->busy_poll)
		prctl(PR_SET_TIMERSLACK, IDLE_TIMER_SLACK_NS, 0, 0, 0);

	while (!force_quit && !bench_done(a)) {
		uint64_t got = 0;
		for (uint16_t p = 0; p < a->nb_ports; p++) {
			uint16_t n = poll_port(a, p, pkts, in_port);
			if (n == 0)
				continue;
			if (unlikely(a->forward_only))
				forward_plain(a, pkts, in_port, n);
			else
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
		if (!a->busy_poll)
			back_off(a, &idle, got || rated_backlog(a), now);
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
			struct rte_eth_stats es;
			bool nombuf = rte_eth_stats_get((uint16_t)p, &es) == 0 && es.rx_nombuf > 0;
			fprintf(stderr, "thc_switch: schedule line %d: port %lu has no more input%s\n",
				lineno, p, nombuf ? " (out of mbufs: a bug in the pool sizing)" : "");
			fclose(f);
			return -1;
		}
		if (rx_fits(&a->ports[p], m))
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

static int cmp_u64(const void *x, const void *y)
{
	uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
	return a < b ? -1 : a > b;
}

/* The generator through the live poll loop; prints one BENCH line of JSON. */
static int bench_run(struct app *a)
{
	if (bench_setup(a) < 0)
		return -1;
	const struct agg_job *job = a->bench.job;
	uint64_t results_before = job->c.results_multicast;
	/* CPU time of this thread as well as wall time: on a shared machine the
	 * wall clock also counts the time other processes had the core. */
	struct timespec cpu0, cpu1;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
	uint64_t start = rte_rdtsc();
	main_loop(a);
	uint64_t cycles = rte_rdtsc() - start;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
	double hz = (double)rte_get_tsc_hz();
	double wall = (double)cycles / hz;
	double secs = (double)(cpu1.tv_sec - cpu0.tv_sec) + (double)(cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
	uint64_t done = a->bench.generated, aggregated = job->c.aggregated;
	/* Pick-up delay of the bursts offered after a gap (--bench-gap-us). */
	struct bench_state *b = &a->bench;
	double wait_mean = 0, wait_med = 0, wait_p99 = 0, wait_max = 0;
	if (b->nb_waits) {
		qsort(b->waits, b->nb_waits, sizeof(*b->waits), cmp_u64);
		for (uint64_t i = 0; i < b->nb_waits; i++)
			wait_mean += (double)b->waits[i];
		wait_mean = wait_mean / (double)b->nb_waits * 1e6 / hz;
		wait_med = (double)b->waits[b->nb_waits / 2] * 1e6 / hz;
		wait_p99 = (double)b->waits[b->nb_waits * 99 / 100] * 1e6 / hz;
		wait_max = (double)b->waits[b->nb_waits - 1] * 1e6 / hz;
	}
	printf("BENCH {\"mode\": \"%s\", \"polling\": \"%s\", \"packets\": %" PRIu64 ", \"workers\": %u, "
	       "\"values_per_packet\": %u, \"wall_seconds\": %.6f, \"cpu_seconds\": %.6f, \"packets_per_s\": %.1f, "
	       "\"values_per_s\": %.1f, \"results\": %" PRIu64 ", \"gap_us\": %u, \"bursts_after_gap\": %" PRIu64
	       ", \"pickup_us_mean\": %.2f, \"pickup_us_median\": %.2f, \"pickup_us_p99\": %.2f, "
	       "\"pickup_us_max\": %.2f}\n",
	       a->forward_only ? "forward" : "aggregate", a->busy_poll ? "busy" : "adaptive", done,
	       b->nw, a->bench_values, wall, secs, (double)done / secs,
	       a->forward_only ? (double)done * a->bench_values / secs
			       : (double)aggregated * a->bench_values / secs,
	       job->c.results_multicast - results_before, a->bench_gap_us, b->nb_waits,
	       wait_mean, wait_med, wait_p99, wait_max);
	free(b->waits);
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

/* framesz= of an af_packet port's devargs (the ring frame size). */
static uint32_t af_packet_framesz(const struct rte_device *dev)
{
	uint32_t framesz = AF_PACKET_FRAMESZ;
	const struct rte_devargs *da = rte_dev_devargs(dev);
	struct rte_kvargs *kv = da && da->args ? rte_kvargs_parse(da->args, NULL) : NULL;
	const char *v = kv ? rte_kvargs_get(kv, "framesz") : NULL;
	if (v != NULL)
		framesz = (uint32_t)strtoul(v, NULL, 10);
	rte_kvargs_free(kv);
	return framesz;
}

/* What a port's driver implies: the longest frames it receives whole and can
 * send, and whether it keeps mbufs in its rings (the copying virtual devices
 * take an mbuf per received frame and free each sent one at once). */
static void port_traits(struct port_state *ps, uint16_t port, const struct rte_eth_dev_info *info)
{
	const char *drv = info->driver_name;
	uint16_t mtu = RTE_ETHER_MTU;
	bool copies = !strcmp(drv, "net_af_packet") || !strcmp(drv, "net_pcap") ||
		      !strcmp(drv, "net_null");
	ps->ring_mbufs = copies ? 0 : (uint32_t)ps->nb_rxd + ps->nb_txd;
	ps->rx_max = ps->tx_max = MAX_FRAME;
	if (!strcmp(drv, "net_af_packet")) {
		uint32_t framesz = af_packet_framesz(info->device);
		ps->is_af_packet = true;
		ps->if_index = info->if_index;
		ps->rx_max = framesz > AF_PACKET_RX_HEADROOM ?
			RTE_MIN(MAX_FRAME, framesz - AF_PACKET_RX_HEADROOM - 1) : 0;
		ps->tx_max = framesz > AF_PACKET_TX_HEADROOM ?
			RTE_MIN(MAX_FRAME, framesz - AF_PACKET_TX_HEADROOM) : 0;
	} else if (!copies && strcmp(drv, "net_ring")) {
		ps->is_tap = !strcmp(drv, "net_tap");
		/* net_tap (whose ethdev MTU DPDK 22.11 caps at 1504) and NICs send
		 * what their MTU allows, a VLAN tag included. */
		rte_eth_dev_get_mtu(port, &mtu);
		ps->tx_max = RTE_MIN(MAX_FRAME, (uint32_t)mtu + RTE_ETHER_HDR_LEN + RTE_ETHER_CRC_LEN + 4);
	}
}

static int port_configure(struct app *a, uint16_t port)
{
	struct port_state *ps = &a->ports[port];
	struct rte_eth_conf conf;
	struct rte_eth_dev_info info;
	int rc;

	memset(&conf, 0, sizeof(conf));
	if ((rc = rte_eth_dev_info_get(port, &info)) != 0)
		return rc;
	ps->nb_rxd = RX_DESC;
	ps->nb_txd = TX_DESC;
	port_traits(ps, port, &info);
	/* A tap's rx "interrupt" is its queue's descriptor: something to sleep on. */
	conf.intr_conf.rxq = ps->is_tap;
	if ((rc = rte_eth_dev_configure(port, 1, 1, &conf)) != 0)
		return rc;
	if ((rc = rte_eth_dev_adjust_nb_rx_tx_desc(port, &ps->nb_rxd, &ps->nb_txd)) != 0)
		return rc;
	port_traits(ps, port, &info);       /* with the adjusted ring sizes */
	return 0;
}

static int port_start(struct app *a, uint16_t port)
{
	struct port_state *ps = &a->ports[port];
	int rc = rte_eth_rx_queue_setup(port, 0, ps->nb_rxd, rte_eth_dev_socket_id(port), NULL,
					a->pool);
	if (rc < 0) {
		if (ps->is_af_packet)
			fprintf(stderr, "thc_switch: port %u: an af_packet ring frame must fit an mbuf "
				"(%u bytes of data): use framesz <= %u\n", port, MBUF_ROOM,
				MBUF_ROOM + AF_PACKET_TX_HEADROOM);
		return rc;
	}
	rc = rte_eth_tx_queue_setup(port, 0, ps->nb_txd, rte_eth_dev_socket_id(port), NULL);
	if (rc < 0)
		return rc;
	if ((rc = rte_eth_dev_start(port)) < 0)
		return rc;
	rte_eth_promiscuous_enable(port);   /* not every PMD supports it; fine */
	return 0;
}

/* ---- the mbuf pool, sized from the configuration (issue 11.3) --------------- */

/* Queues a frame can be admitted to: the DSCP map's, and queue 0 (non-IPv4). */
static uint32_t reachable_queues(const struct agg_dlcp_config *d)
{
	uint32_t seen = 1;
	for (int i = 0; i < 64; i++)
		seen |= 1u << d->dscp[i].queue;
	return (uint32_t)__builtin_popcount(seen);
}

/* Every mbuf the switch may hold at once: what the DLCP queues of a rated or
 * paused port admit (capacity per queue), what a PMD keeps in its rx and tx
 * rings, a burst buffer per port, and one burst each of input, emissions, the
 * emission stash, frames waiting to be freed and the benchmark generator. */
static uint64_t mbufs_needed(const struct app *a, uint64_t *queued)
{
	uint64_t per_port_queue = (uint64_t)reachable_queues(&a->sw.dlcp) * a->sw.dlcp.capacity;
	uint64_t n = 4 * BURST_SIZE + MAX_EMIT;
	*queued = 0;
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		const struct port_state *ps = &a->ports[p];
		n += (uint64_t)ps->ring_mbufs + BURST_SIZE;
		if (ps->rate >= 0)
			*queued += per_port_queue;
	}
	/* A mempool needs at least 1.5 times its per-lcore cache. */
	return RTE_MAX(n + *queued, (uint64_t)2 * MBUF_CACHE);
}

/* Ports that copy frames with the CPU (all virtual devices) can take mbufs from
 * anonymous memory, outside EAL's fixed -m; a NIC needs EAL (DMA) memory. */
static bool only_virtual_ports(uint16_t nb_ports)
{
	for (uint16_t p = 0; p < nb_ports; p++) {
		struct rte_eth_dev_info info;
		if (rte_eth_dev_info_get(p, &info) != 0 ||
		    strcmp(rte_bus_name(rte_dev_bus(info.device)), "vdev"))
			return false;
	}
	return true;
}

struct mapping {
	void *addr;
	size_t len;
};

static void unmap_chunk(struct rte_mempool_memhdr *memhdr, void *opaque)
{
	const struct mapping *map = opaque;
	munmap(map->addr, map->len);
}

/* The pool in one anonymous mapping. Unlike rte_mempool_populate_anon it does
 * not lock the mapping: only the pages the mbuf headers sit on are touched at
 * start, the data rooms as frames use them. */
static struct rte_mempool *pool_create_anonymous(uint32_t n, uint16_t room)
{
	struct rte_pktmbuf_pool_private priv = { .mbuf_data_room_size = room };
	uint32_t elt = sizeof(struct rte_mbuf) + room;
	struct rte_mempool_objsz sz;
	rte_mempool_calc_obj_size(elt, RTE_MEMPOOL_F_NO_IOVA_CONTIG, &sz);
	static struct mapping map;
	size_t len = (size_t)n * sz.total_size + (size_t)getpagesize();
	struct rte_mempool *mp = rte_mempool_create_empty("mbufs", n, elt, MBUF_CACHE, sizeof(priv),
							  rte_socket_id(), RTE_MEMPOOL_F_NO_IOVA_CONTIG);
	if (mp == NULL)
		return NULL;
	void *addr = MAP_FAILED;
	if (rte_mempool_set_ops_byname(mp, rte_mbuf_best_mempool_ops(), NULL) != 0)
		goto fail;
	rte_pktmbuf_pool_init(mp, &priv);
	addr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (addr == MAP_FAILED)
		goto fail;
	map = (struct mapping){ addr, len };
	if (rte_mempool_populate_virt(mp, addr, len, (size_t)getpagesize(), unmap_chunk, &map) <= 0 ||
	    mp->populated_size != n)
		goto fail;
	rte_mempool_obj_iter(mp, rte_pktmbuf_init, NULL);
	return mp;
fail:
	if (addr != MAP_FAILED && STAILQ_EMPTY(&mp->mem_list))
		munmap(addr, len);
	rte_mempool_free(mp);
	return NULL;
}

static struct rte_mempool *pool_create(uint32_t n, bool anonymous)
{
	uint16_t room = RTE_PKTMBUF_HEADROOM + MBUF_ROOM;
	if (anonymous)
		return pool_create_anonymous(n, room);
	return rte_pktmbuf_pool_create("mbufs", n, MBUF_CACHE, 0, room, rte_socket_id());
}

/* Creates the pool, or says which limit the configuration exceeds and what to
 * lower. Returns 0, or -1 after printing the refusal. */
static int setup_pool(struct app *a)
{
	uint64_t queued, n = mbufs_needed(a, &queued);
	uint32_t obj = rte_mempool_calc_obj_size(sizeof(struct rte_mbuf) + RTE_PKTMBUF_HEADROOM +
						 MBUF_ROOM, 0, NULL);
	uint64_t mib = (n * obj) >> 20;
	uint64_t ram_mib = ((uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE)) >> 20;
	bool anonymous = only_virtual_ports(a->nb_ports);
	const char *why = NULL;
	if (mib > ram_mib / 2)
		why = "more than half of this machine's memory";
	else if ((a->pool = pool_create((uint32_t)n, anonymous)) == NULL)
		why = anonymous ? "the allocation failed" : "more than EAL's memory holds (-m, hugepages)";
	if (why == NULL)
		return 0;
	fprintf(stderr, "thc_switch: refusing configuration %s: it can hold %" PRIu64 " frames at once "
		"(%" PRIu64 " in the DLCP queues of rated or paused ports: %u reachable queues x capacity "
		"%u each; the rest in rings and bursts), %" PRIu64 " MiB of %u-byte mbufs: %s (%" PRIu64
		" MiB of RAM); lower the DLCP capacity or pause or rate fewer ports%s\n",
		a->config_path, n, queued, reachable_queues(&a->sw.dlcp), a->sw.dlcp.capacity, mib,
		obj, why, ram_mib, anonymous ? "" : ", or give EAL more memory (-m)");
	return -1;
}

static void usage(const char *prog)
{
	fprintf(stderr,
		"usage: %s [EAL options] -- --config FILE [--stats FILE] [--rate PORT:PPS]...\n"
		"       [--schedule FILE] [--exit-idle-ms MS] [--busy-poll] [--idle-sleep-max-us US]\n"
		"       [--bench PACKETS [--bench-values N] [--forward-only] [--bench-gap-us US]]\n", prog);
}

static int parse_args(struct app *a, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "stats", required_argument, NULL, 's' },
		{ "rate", required_argument, NULL, 'r' },
		{ "schedule", required_argument, NULL, 'S' },
		{ "exit-idle-ms", required_argument, NULL, 'i' },
		{ "busy-poll", no_argument, NULL, 'B' },
		{ "idle-sleep-max-us", required_argument, NULL, 'I' },
		{ "bench", required_argument, NULL, 'b' },
		{ "bench-values", required_argument, NULL, 'v' },
		{ "bench-gap-us", required_argument, NULL, 'g' },
		{ "forward-only", no_argument, NULL, 'f' },
		{ NULL, 0, NULL, 0 },
	};
	int opt;
	for (int p = 0; p < (int)AGG_MAX_PORTS; p++)
		a->ports[p].rate = RATE_UNLIMITED;
	a->bench_values = 0;            /* the job's values_per_packet (bench_setup) */
	a->idle_sleep_max_us = IDLE_SLEEP_MAX_US;
	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (opt) {
		case 'c': a->config_path = optarg; break;
		case 's': a->stats_path = optarg; break;
		case 'S': a->schedule_path = optarg; break;
		case 'i': a->exit_idle_ms = strtoull(optarg, NULL, 10); break;
		case 'B': a->busy_poll = true; break;
		case 'I':
			a->idle_sleep_max_us = (uint32_t)strtoul(optarg, NULL, 10);
			if (a->idle_sleep_max_us < IDLE_SLEEP_MIN_US || a->idle_sleep_max_us > 100000) {
				fprintf(stderr, "--idle-sleep-max-us must be in %u..100000\n", IDLE_SLEEP_MIN_US);
				return -1;
			}
			break;
		case 'b': a->bench_packets = strtoull(optarg, NULL, 10); break;
		case 'g': a->bench_gap_us = (uint32_t)strtoul(optarg, NULL, 10); break;
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

	bool af_packet = false;
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		if ((rc = port_configure(a, p)) != 0)
			rte_exit(EXIT_FAILURE, "cannot configure port %u: %s\n", p, rte_strerror(-rc));
		af_packet |= a->ports[p].is_af_packet;
	}
	if (af_packet && thc_af_packet_defrag_cleared == 0)
		fprintf(stderr, "thc_switch: warning: the kernel reassembles IPv4 fragments before "
			"af_packet ports see them (PACKET_FANOUT_FLAG_DEFRAG could not be cleared)\n");
	if (setup_pool(a) < 0) {
		rte_eal_cleanup();
		return 2;
	}
	if (setup_lpm(a) < 0)
		rte_exit(EXIT_FAILURE, "cannot build the route table\n");
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		/* An unlimited port sends at once: its queues never hold a frame. */
		int unlimited = a->ports[p].rate < 0;
		if (dlcp_port_init(&a->ports[p].dlcp, unlimited ? 1 : a->sw.dlcp.capacity, unlimited) < 0)
			rte_exit(EXIT_FAILURE, "out of memory for DLCP queues\n");
		if ((rc = port_start(a, p)) != 0)
			rte_exit(EXIT_FAILURE, "cannot start port %u: %s\n", p, rte_strerror(-rc));
		a->ports[p].last_tsc = rte_rdtsc();
	}

	setup_wakeup(a);
	printf("thc_switch: %u ports, %u jobs, %u routes, %u mbufs, %s: running\n", a->nb_ports,
	       a->sw.num_jobs, a->sw.num_routes, rte_mempool_avail_count(a->pool),
	       a->busy_poll ? "busy polling" : a->nb_wake ? "sleeps on its ports when idle" :
	       "sleeps when idle");
	fflush(stdout);
	if (a->bench_packets)
		rc = bench_run(a);
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
