/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The live rx -> process -> DLCP enqueue -> strict-priority tx loop of thc_switch:
 * main_loop polls every port (or, with --bench, the generator of bench.c in port
 * 0's place), hands each frame to the aggregation core, sends what the core emits
 * and what it forwards through the port's DLCP stage, and serves every port's
 * queues (unlimited, token-bucket rated, or paused until the input is done). It
 * runs until SIGINT/SIGTERM, --exit-idle-ms of silence or the end of the benchmark,
 * sleeping when idle unless --busy-poll: in poll() on the ports' descriptors where
 * every port has one, otherwise in timed sleeps that grow up to
 * --idle-sleep-max-us. The frame processing and the DLCP service here are the
 * ones the pcap schedule (schedule_loop.c) drives one frame at a time.
 */
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <time.h>

#include <rte_common.h>
#include <rte_cycles.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_pause.h>

#include "af_packet_sockets.h"
#include "agg_core.h"
#include "switch_app.h"

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

void process_packet(struct app *a, struct rte_mbuf *m, uint16_t in_port)
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

void tx_all(struct app *a, uint16_t port, struct rte_mbuf **pkts, uint16_t n)
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
void service_ports(struct app *a)
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

void drain_all(struct app *a)
{
	free_consumed(a);
	for (uint16_t p = 0; p < a->nb_ports; p++) {
		flush_txbuf(a, p);
		drain_port(a, p, UINT64_MAX);
	}
}

/* ---- receive ----------------------------------------------------------------- */

static uint16_t rx_port(struct app *a, uint16_t p, struct rte_mbuf **pkts, uint16_t *in_port)
{
	struct port_state *ps = &a->ports[p];
	uint16_t n = rte_eth_rx_burst(p, 0, pkts, BURST_SIZE), kept = 0;
	for (uint16_t i = 0; i < n; i++) {
		if (!rx_fits(a, ps, pkts[i]))
			continue;
		pkts[kept] = pkts[i];
		in_port[kept++] = p;
	}
	return kept;
}

/* ---- the poll loop ----------------------------------------------------------- */

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
void setup_wakeup(struct app *a)
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
void main_loop(struct app *a)
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
