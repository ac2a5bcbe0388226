/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The --schedule loop of thc_switch, for deterministic runs over pcap ports (the
 * packet suite, tests/packet): the schedule file names, one line per frame, the port
 * to read the next frame from, or 'drain' to empty every queue, paused ports
 * included. Each frame goes through the same processing and DLCP service as in the
 * live loop (live_loop.c), one at a time; at the end of the schedule every queue
 * drains and the switch exits. A line that names no port, or a port with no frame
 * left, ends the run with an error that says which line.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_ethdev.h>
#include <rte_mbuf.h>

#include "switch_app.h"

/* Deterministic: read packets in the scheduled cross-port order, one at a time. */
int schedule_loop(struct app *a)
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
		if (rx_fits(a, &a->ports[p], m))
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
