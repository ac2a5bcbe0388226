/* SPDX-License-Identifier: BSD-3-Clause
 *
 * Port set-up of thc_switch: each port is configured with one rx and one tx queue,
 * and what its driver implies is recorded in its port_state before the mbuf pool is
 * sized (mbuf_pool.c): the longest frame it receives whole and can send (af_packet
 * rings cut frames silently, taps and NICs send what their MTU allows), whether its
 * rings keep mbufs, and what the live loop may sleep on when idle (an af_packet
 * socket, or a tap queue's rx interrupt, which is enabled here). port_start then
 * sets up the queues on the pool and starts the port.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_common.h>
#include <rte_dev.h>
#include <rte_devargs.h>
#include <rte_ethdev.h>
#include <rte_kvargs.h>

#include "switch_app.h"

#define RX_DESC         1024
#define TX_DESC         1024

/* The longest frame the switch receives or sends (docs/protocol.md §8): a 9000-byte
 * MTU plus Ethernet and VLAN headers, with room (an 8192-value RESULT is 8266 bytes). */
#define MAX_FRAME       AGG_MAX_WIRE_FRAME
/* af_packet (TPACKET_V2) puts an Ethernet frame 66 bytes into a ring frame of
 * framesz bytes and cuts what does not fit without saying so: only frames
 * shorter than framesz - 66 are known to be whole. It sends up to framesz - 32. */
#define AF_PACKET_RX_HEADROOM   66u
#define AF_PACKET_TX_HEADROOM   32u
#define AF_PACKET_FRAMESZ       2048u   /* the PMD's default */

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

int port_configure(struct app *a, uint16_t port)
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

/* An af_packet socket is made for every interface (ETH_P_ALL) and bound to its own
 * only later, so it can hold frames of other interfaces (loopback traffic on a busy
 * machine) from before the port started: they never came in on this port, so they
 * are dropped here, before any counter sees them, and reported as rx_flushed. */
static uint64_t flush_rx(uint16_t port)
{
	struct rte_mbuf *pkts[BURST_SIZE];
	uint64_t flushed = 0;
	uint16_t n;
	while ((n = rte_eth_rx_burst(port, 0, pkts, BURST_SIZE)) > 0) {
		rte_pktmbuf_free_bulk(pkts, n);
		flushed += n;
	}
	return flushed;
}

int port_start(struct app *a, uint16_t port)
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
	if (ps->is_af_packet)
		ps->rx_flushed = flush_rx(port);
	return 0;
}
