/* SPDX-License-Identifier: BSD-3-Clause
 *
 * What the switch needs from the af_packet PMD's sockets, which DPDK 22.11 does
 * not let an application reach or configure.
 *
 * 1. Fragments as they are (protocol v2, R4). The PMD puts every socket it opens
 *    into a PACKET_FANOUT group with PACKET_FANOUT_FLAG_DEFRAG
 *    (rte_eth_af_packet.c; no devarg changes it before DPDK 24), so the kernel
 *    reassembles IPv4 fragments before the switch sees them: a lone fragment
 *    vanishes uncounted and two fragments of one DATA arrive as one packet.
 * 2. A poll loop that can sleep until a frame arrives, so that an idle switch
 *    leaves the CPU alone: the sockets' descriptors, to poll() on.
 *
 * This definition of setsockopt comes first in the symbol lookup of every
 * library the process loads (the executable exports it, see the Makefile). The
 * PMD's PACKET_FANOUT request reaches the kernel without the DEFRAG flag and its
 * socket is recorded; everything else passes through unchanged.
 */
#define _GNU_SOURCE
#include <linux/if_packet.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "af_packet_sockets.h"

unsigned int thc_af_packet_defrag_cleared;
static int fds[THC_AF_PACKET_MAX_SOCKETS];
static unsigned int nb_fds;

int setsockopt(int fd, int level, int optname, const void *optval, socklen_t optlen)
{
	if (level != SOL_PACKET || optname != PACKET_FANOUT || optval == NULL ||
	    optlen != sizeof(int))
		return (int)syscall(SYS_setsockopt, fd, level, optname, optval, optlen);
	int arg = *(const int *)optval;
	if (arg & (PACKET_FANOUT_FLAG_DEFRAG << 16)) {
		arg &= ~(PACKET_FANOUT_FLAG_DEFRAG << 16);
		thc_af_packet_defrag_cleared++;
	}
	int rc = (int)syscall(SYS_setsockopt, fd, level, optname, &arg, optlen);
	if (rc == 0 && nb_fds < THC_AF_PACKET_MAX_SOCKETS)
		fds[nb_fds++] = fd;
	return rc;
}

int thc_af_packet_fd(int ifindex)
{
	for (unsigned int i = 0; i < nb_fds; i++) {
		struct sockaddr_ll sll;
		socklen_t len = sizeof(sll);
		if (getsockname(fds[i], (struct sockaddr *)&sll, &len) == 0 &&
		    sll.sll_family == AF_PACKET && sll.sll_ifindex == ifindex)
			return fds[i];
	}
	return -1;
}
