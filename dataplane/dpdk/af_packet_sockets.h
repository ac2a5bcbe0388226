/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The af_packet PMD's sockets, as af_packet_sockets.c sees them being set up.
 */
#ifndef AF_PACKET_SOCKETS_H
#define AF_PACKET_SOCKETS_H

#define THC_AF_PACKET_MAX_SOCKETS 64

/* Sockets whose kernel reassembly (PACKET_FANOUT_FLAG_DEFRAG) was turned off. */
extern unsigned int thc_af_packet_defrag_cleared;

/* The PMD socket bound to the interface with this index, or -1. Only while the
 * PMD's port is open. */
int thc_af_packet_fd(int ifindex);

#endif
