/* SPDX-License-Identifier: BSD-3-Clause
 *
 * thc_switch: the THC-INA aggregation switch on DPDK (docs/protocol.md, protocol
 * v2). This file parses the options, loads the configuration (agg_config.c), sets
 * up the ports (ports.c), the mbuf pool (mbuf_pool.c) and the route table, runs one
 * of the loops (live_loop.c, schedule_loop.c, bench.c) and writes the statistics.
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
 * Frames: up to MAX_FRAME bytes (ports.c) pass whole; what a port cannot receive whole (or is
 *   longer) is dropped and counted drop_oversize (docs/protocol.md §4.1) and, for the
 *   port, rx_oversize; what it cannot send, tx_oversize. An af_packet port's frames
 *   from before it started (caught before its socket was bound) are flushed, never
 *   processed: rx_flushed.
 * Statistics go to --stats (JSON) on exit and on SIGUSR1; without --stats, to stdout.
 * Stdout otherwise carries the one start-up line ("... running").
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_common.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_lpm.h>
#include <rte_mbuf.h>

#include "af_packet_sockets.h"
#include "agg_core.h"
#include "switch_app.h"

struct app app;
volatile bool force_quit;
volatile bool dump_stats;

static void signal_handler(int signum)
{
	if (signum == SIGUSR1)
		dump_stats = true;
	else
		force_quit = true;
}

/* ---- statistics ---------------------------------------------------------- */

void write_stats(struct app *a)
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
			", \"rx_nombuf\": %" PRIu64 ", \"rx_max\": %u, \"tx_max\": %u"
			", \"rx_flushed\": %" PRIu64 "}", p ? ", " : "", p,
			ps->rx, ps->tx, ps->tx_dropped, ps->tx_nombuf, ps->dlcp.queued, ps->rx_oversize,
			ps->tx_oversize, es.imissed, es.ierrors, es.rx_nombuf, ps->rx_max, ps->tx_max,
			ps->rx_flushed);
	}
	if (n < sizeof(extra))
		snprintf(extra + n, sizeof(extra) - n, "}");
	/* With a stats file the counters go there only: a long-running switch must
	 * never block on a stdout pipe that nobody reads. */
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

/* ---- routes ---------------------------------------------------------------- */

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

/* ---- options and start-up ---------------------------------------------------- */

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
