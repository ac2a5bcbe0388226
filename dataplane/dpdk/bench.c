/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The in-memory benchmark of thc_switch (--bench PACKETS): a generator stands in
 * for port 0's rx inside the live poll loop (live_loop.c), offering bursts of DATA
 * frames of every member of the config's first job (from per-worker templates, slot
 * and round patched so that each slot's round advances only after every member
 * contributed), either back to back or one burst per --bench-gap-us of idle time.
 * --forward-only swaps the aggregation for a plain l2fwd-style forwarder to compare
 * against. bench_run prints one BENCH line of JSON: packets and values per second
 * of CPU time, wall time, and how long bursts offered after a gap waited to be
 * picked up.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rte_common.h>
#include <rte_cycles.h>
#include <rte_mbuf.h>
#include <rte_random.h>

#include "agg_core.h"
#include "switch_app.h"

/* ---- the generator ---------------------------------------------------------- */

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

/* Worker w's packet k of the stream: slots in turn, each slot's round advancing
 * only after every member contributed (the window rule of §4.4). Frames come in
 * bursts as from a NIC (mbufs from the pool, a template copied, slot and round
 * patched), all on "port 0": each carries its member's port as its in_port. */
uint16_t bench_rx(struct app *a, uint16_t p, struct rte_mbuf **pkts, uint16_t *in_port)
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
void forward_plain(struct app *a, struct rte_mbuf **pkts, const uint16_t *in_port,
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

/* ---- the run ---------------------------------------------------------------- */

static int cmp_u64(const void *x, const void *y)
{
	uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
	return a < b ? -1 : a > b;
}

/* The generator through the live poll loop; prints one BENCH line of JSON. */
int bench_run(struct app *a)
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
