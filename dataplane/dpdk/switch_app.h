/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The thc_switch application around the aggregation core (agg_core.h): the state
 * its run loops share (ports, mbuf pool, the frame being processed, the benchmark
 * generator) and the functions one file of it offers the others. main.c parses the
 * options and starts one of the loops: the live loop (live_loop.c), the pcap
 * schedule (schedule_loop.c) or the benchmark (bench.c), after ports.c and
 * mbuf_pool.c have set up the ports and the pool.
 */
#ifndef SWITCH_APP_H
#define SWITCH_APP_H

#include <poll.h>
#include <stdbool.h>
#include <stdint.h>

#include <rte_branch_prediction.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#include "agg_core.h"

#define BURST_SIZE      32
#define MAX_EMIT        (AGG_MAX_WORKERS + 1)
#define RATE_UNLIMITED  (-1.0)

/* Data room of every mbuf after its headroom: one segment holds any frame the
 * switch accepts, so the core always sees a whole frame. It also fits an
 * af_packet ring frame of up to 10272 bytes (framesz), which that PMD requires. */
#define MBUF_ROOM       10240u

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

struct rte_lpm;

struct port_state {
	struct dlcp_port dlcp;
	double rate;            /* packets/s; RATE_UNLIMITED; 0 = paused */
	double tokens;
	uint64_t last_tsc;
	uint64_t rx, tx, tx_dropped, tx_nombuf, rx_oversize, tx_oversize;
	uint64_t rx_flushed;    /* af_packet: frames in the ring before the port started */
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

extern struct app app;
extern volatile bool force_quit;     /* SIGINT/SIGTERM: every loop ends */
extern volatile bool dump_stats;     /* SIGUSR1: write the statistics now */

/* Whether a received frame may go on: one the port may have cut (or that is
 * longer than the switch handles) is dropped and counted, never forwarded cut:
 * drop_oversize for the protocol (docs/protocol.md §4.1, §8), rx_oversize for the
 * port. A frame of at most rx_max bytes is one segment (MBUF_ROOM). */
static inline bool rx_fits(struct app *a, struct port_state *ps, struct rte_mbuf *m)
{
	if (likely(rte_pktmbuf_pkt_len(m) <= ps->rx_max))
		return true;
	ps->rx++;                 /* a frame received, like every other (§4.5's balance) */
	ps->rx_oversize++;
	a->sw.g.drop_oversize++;
	rte_pktmbuf_free(m);
	return false;
}

/* --bench: the generator has offered every packet asked for. */
static inline bool bench_done(const struct app *a)
{
	return a->bench_packets && a->bench.generated >= a->bench_packets;
}

/* main.c */
void write_stats(struct app *a);

/* live_loop.c */
void process_packet(struct app *a, struct rte_mbuf *m, uint16_t in_port);
void tx_all(struct app *a, uint16_t port, struct rte_mbuf **pkts, uint16_t n);
void service_ports(struct app *a);
void drain_all(struct app *a);
void setup_wakeup(struct app *a);
void main_loop(struct app *a);

/* schedule_loop.c */
int schedule_loop(struct app *a);

/* bench.c */
uint16_t bench_rx(struct app *a, uint16_t p, struct rte_mbuf **pkts, uint16_t *in_port);
void forward_plain(struct app *a, struct rte_mbuf **pkts, const uint16_t *in_port, uint16_t n);
int bench_run(struct app *a);

/* ports.c */
int port_configure(struct app *a, uint16_t port);
int port_start(struct app *a, uint16_t port);

/* mbuf_pool.c */
int setup_pool(struct app *a);

#endif
