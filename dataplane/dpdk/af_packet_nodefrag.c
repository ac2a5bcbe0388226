/* SPDX-License-Identifier: BSD-3-Clause
 *
 * Live ports see IPv4 fragments as they are (protocol v2, R4).
 *
 * DPDK 22.11's af_packet PMD puts every socket it opens into a PACKET_FANOUT
 * group with PACKET_FANOUT_FLAG_DEFRAG (rte_eth_af_packet.c, no devarg to change
 * it; later releases added one), so the kernel reassembles fragments before the
 * switch sees them: a lone fragment vanishes uncounted and two fragments of one
 * DATA arrive as one packet. This definition of setsockopt comes first in the
 * symbol lookup of every library the process loads (the executable exports it,
 * see the Makefile), so the PMD's request reaches the kernel without that flag;
 * everything else passes through unchanged.
 */
#define _GNU_SOURCE
#include <linux/if_packet.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

unsigned int thc_af_packet_defrag_cleared;

int setsockopt(int fd, int level, int optname, const void *optval, socklen_t optlen)
{
	if (level == SOL_PACKET && optname == PACKET_FANOUT && optval != NULL &&
	    optlen == sizeof(int)) {
		int arg = *(const int *)optval;
		if (arg & (PACKET_FANOUT_FLAG_DEFRAG << 16)) {
			arg &= ~(PACKET_FANOUT_FLAG_DEFRAG << 16);
			thc_af_packet_defrag_cleared++;
		}
		return (int)syscall(SYS_setsockopt, fd, level, optname, &arg, optlen);
	}
	return (int)syscall(SYS_setsockopt, fd, level, optname, optval, optlen);
}
