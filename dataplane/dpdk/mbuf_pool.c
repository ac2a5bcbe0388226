/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The mbuf pool of thc_switch, sized from the configuration: every mbuf the switch
 * may hold at once (the DLCP queues of rated or paused ports at their capacity, what
 * the PMDs keep in their rings, a burst buffer per port and a few bursts in flight),
 * each with a data room that holds any frame the switch accepts in one segment.
 * With only virtual ports the pool lives in anonymous memory, outside EAL's fixed
 * -m; with a NIC, in EAL (DMA) memory. A configuration that needs more than half of
 * the machine's memory, or more than the allocation can give, is refused with a
 * message that says which limit it exceeds and what to lower.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <rte_bus.h>
#include <rte_common.h>
#include <rte_dev.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mbuf_pool_ops.h>
#include <rte_mempool.h>

#include "agg_core.h"
#include "switch_app.h"

#define MBUF_CACHE      256

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
int setup_pool(struct app *a)
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
