/* Counter layout (protocol.md 4.5). The counter arrays are declared in SwitchIngress
 * (main.p4: job_counters, global_counters) and DlcpAdmission (dlcp.p4: dlcp_counters);
 * dataplane/bmv2/control.py reads the cells back under the protocol's names. */
#ifndef _THC_INA_COUNTERS_P4_
#define _THC_INA_COUNTERS_P4_

#define JOB_COUNTER_STRIDE 16       /* counter cells per job */
#define GLOBAL_COUNTER_CELLS 9

/* Per-job counter cells: job_index * JOB_COUNTER_STRIDE + JC_*; names as protocol.md 4.5. */
const bit<32> JC_RX                = 0;
const bit<32> JC_AGGREGATED        = 1;
const bit<32> JC_RESULTS_MULTICAST = 2;
const bit<32> JC_RESULTS_RESERVED  = 3;
const bit<32> JC_STRAGGLER_NOTICES = 4;
const bit<32> JC_FLUSHES           = 5;
const bit<32> JC_DROP_BAD_SLOT     = 6;
const bit<32> JC_DROP_NOT_MEMBER   = 7;
const bit<32> JC_DROP_BAD_EXPECTED = 8;
const bit<32> JC_DROP_DUPLICATE    = 9;
const bit<32> JC_DROP_UNSATISFIABLE = 10;

/* Global counter cells of the ingress (global_counters). */
const bit<32> GC_DROP_TRUNCATED    = 0;
const bit<32> GC_DROP_BAD_VERSION  = 1;
const bit<32> GC_DROP_BAD_TYPE     = 2;
const bit<32> GC_DROP_BAD_LENGTH   = 3;
const bit<32> GC_DROP_UNKNOWN_JOB  = 4;
const bit<32> GC_DROP_NOT_ROUTABLE = 5;
const bit<32> GC_FORWARDED         = 6;
const bit<32> GC_DROP_FRAGMENT     = 7;
const bit<32> GC_DROP_OVERSIZE     = 8;

/* Egress DLCP counter cells (dlcp.p4: DlcpAdmission.dlcp_counters). */
const bit<32> DC_SELECTIVE_DROP = 0;
const bit<32> DC_BUFFER_DROP    = 1;
const bit<32> DC_CE_MARKED      = 2;

#endif
