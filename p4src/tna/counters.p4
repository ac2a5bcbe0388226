/* Counter layout (protocol.md 4.5).
 *
 * A Tofino Counter extern counts at most once per pass, so every packet is counted exactly
 * once in the ingress, either in one per-job cell (the packet got as far as its job) or in
 * one global cell, and once more in the egress DLCP counter when the DLCP stage acts on it.
 * The per-job cells are outcomes, not the protocol names: the control plane
 * (bfrt_scripts/tofino_plan.py, counters_from_cells) derives the names from them:
 *     rx                = pending + complete + duplicate + reserved + straggler + flush
 *     aggregated        = pending + complete
 *     results_multicast = complete
 *     results_reserved  = reserved
 *     straggler_notices = straggler,  flushes = flush,  drop_duplicate = duplicate
 *     drop_* (per job)  = the drop cell of the same name. */
#ifndef _THC_INA_TNA_COUNTERS_P4_
#define _THC_INA_TNA_COUNTERS_P4_

#define JOB_COUNTER_STRIDE   16     /* counter cells per job */
#define GLOBAL_COUNTER_CELLS 16
#define DLCP_COUNTER_CELLS   4

/* Per-job cells: counter_base + JC_*. */
const bit<16> JC_PENDING            = 0;
const bit<16> JC_COMPLETE           = 1;
const bit<16> JC_DUPLICATE          = 2;
const bit<16> JC_RESERVED           = 3;
const bit<16> JC_STRAGGLER          = 4;
const bit<16> JC_FLUSH              = 5;
const bit<16> JC_DROP_BAD_SLOT      = 6;
const bit<16> JC_DROP_NOT_MEMBER    = 7;
const bit<16> JC_DROP_BAD_EXPECTED  = 8;
const bit<16> JC_DROP_UNSATISFIABLE = 9;

/* Global cells of the ingress (global_counters). */
const bit<8> GC_DROP_TRUNCATED    = 0;
const bit<8> GC_DROP_BAD_VERSION  = 1;
const bit<8> GC_DROP_BAD_TYPE     = 2;
const bit<8> GC_DROP_BAD_LENGTH   = 3;
const bit<8> GC_DROP_UNKNOWN_JOB  = 4;
const bit<8> GC_DROP_NOT_ROUTABLE = 5;
const bit<8> GC_FORWARDED         = 6;
const bit<8> GC_DROP_FRAGMENT     = 7;
/* drop_oversize: the ingress cannot see a frame's length, so this cell stays 0 here; the
 * ports' MACs drop frames over 9216 bytes ($RX_MTU set by bfrt_scripts) and the control
 * plane reads their $FrameTooLong count as drop_oversize (protocol.md 8). */
const bit<8> GC_DROP_OVERSIZE     = 8;

/* Egress DLCP cells (dlcp.p4: DlcpAdmission.dlcp_counters). */
const bit<2> DC_SELECTIVE_DROP = 0;
const bit<2> DC_BUFFER_DROP    = 1;
const bit<2> DC_CE_MARKED      = 2;

#endif
