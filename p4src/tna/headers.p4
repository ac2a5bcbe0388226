/* Headers, constants and metadata of the THC-INA program for TNA (Tofino 1 and 2).
 * Wire format: docs/protocol.md sections 1-2, protocol version 2. */
#ifndef _THC_INA_TNA_HEADERS_P4_
#define _THC_INA_TNA_HEADERS_P4_

/* ---- resource limits of this target (p4src/tna/README.md; bfrt_scripts/tofino_plan.py
 *      holds the same numbers and refuses a job description that exceeds them) ---- */
#define MAX_VALUES          64      /* values per packet, one pass (protocol.md section 8) */
#define INDEX_BYTES         32      /* MAX_VALUES / 2 packed 4-bit indices */
#define SUM_WORDS           16      /* MAX_VALUES / 4: four 8-bit lanes per 32-bit register cell */
#define MAX_JOBS            16
#define SLOT_BUDGET         8192    /* slots of all jobs together */
#define SLOT_COPIES         16384   /* two copies (round parity) per slot */
#define MAX_ROUTES          1024
#define MAX_NEXT_HOP_SLOTS  8192    /* MAX_ROUTES x 8 next hops per route */

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<13> slot_index_t;       /* log2(SLOT_BUDGET) */
typedef bit<14> copy_index_t;       /* round parity ++ slot index */
typedef bit<4>  job_index_t;        /* log2(MAX_JOBS): dense job index of the jobs table */
typedef bit<10> route_index_t;      /* log2(MAX_ROUTES) */
typedef bit<13> next_hop_index_t;   /* log2(MAX_NEXT_HOP_SLOTS) */

const bit<16> ETHERTYPE_IPV4  = 0x0800;
const bit<8>  IP_PROTO_UDP    = 17;
const bit<16> AGG_PORT_BASE   = 50000;  /* UDP ports 50000-50015 (dport & 0xFFF0) */
const bit<16> AGG_PORT_MASK   = 0xFFF0;

const bit<4>  AGG_VERSION     = 2;
const bit<4>  TYPE_DATA       = 0;
const bit<4>  TYPE_RESULT     = 1;
const bit<4>  TYPE_STRAGGLER  = 2;
const bit<4>  TYPE_FLUSH      = 3;
const bit<8>  FLAG_RESERVE    = 0x02;
const bit<8>  FLAG_LATE       = 0x04;

const bit<16> AGG_HEADER_LEN  = 32;
const bit<16> UDP_HEADER_LEN  = 8;
const bit<16> IPV4_HEADER_LEN = 20;

/* Outcome of the slot state machine (protocol.md section 4.2). */
const bit<3> OUTCOME_NONE      = 0;  /* not decided yet (validation drop, FLUSH, forwarding) */
const bit<3> OUTCOME_PENDING   = 1;  /* aggregated, round not complete: consumed */
const bit<3> OUTCOME_COMPLETE  = 2;  /* aggregated and completed: multicast RESULT */
const bit<3> OUTCOME_DUPLICATE = 3;  /* retransmission before completion: dropped */
const bit<3> OUTCOME_RESERVE   = 4;  /* copy done: unicast RESULT (RESERVE, LATE set in egress) */
const bit<3> OUTCOME_STRAGGLER = 5;  /* obsolete round: STRAGGLER notice */

/* Version and type of an AGG header (header_checks, validation.p4). */
const bit<2> HEADER_BAD_VERSION = 0;
const bit<2> HEADER_BAD_TYPE    = 1;
const bit<2> HEADER_DATA        = 2;
const bit<2> HEADER_FLUSH       = 3;

/* What the ingress hands the egress (the bridged header, never on the wire). */
const bit<8> BRIDGE_FORWARD       = 1;  /* ordinary IPv4 forwarding */
const bit<8> BRIDGE_AGG_UNICAST   = 2;  /* RESULT re-serve or STRAGGLER to the sender */
const bit<8> BRIDGE_AGG_MULTICAST = 3;  /* RESULT replica; the worker is the egress_rid */

/* Colours the traffic manager's queue colour limits act on (tofino1_base.p4 MeterColor_t). */
const bit<2> COLOR_GREEN  = 0;
const bit<2> COLOR_YELLOW = 1;

/* Ingress -> egress metadata, emitted in front of the Ethernet header. */
header bridge_t {
    bit<8> kind;                /* BRIDGE_* */
    bit<8> dest_worker;         /* unicast replies: the sender's worker id */
    bit<3> queue;               /* DLCP queue (qid) chosen from the DSCP */
    bit<1> is_data;             /* DLCP data band: selective drop and CE marking apply */
    bit<1> yellow;              /* Not-ECT data: the colour the TM drops first */
    bit<3> reserved;
    bit<32> round_back;         /* STRAGGLER: packet round - the copy's round (R1) */
}

header ethernet_t {
    mac_addr_t dst_addr;
    mac_addr_t src_addr;
    bit<16>    ether_type;
}

header ipv4_t {
    bit<4>      version;
    bit<4>      ihl;
    bit<8>      diffserv;       /* DSCP [7:2] = DLCP band, ECN [1:0] = importance (Not-ECT =
                                 * unimportant); one byte, as Tofino's PHV wants it */
    bit<16>     total_len;
    bit<16>     identification;
    bit<3>      flags;          /* reserved, DF, MF (MF = flags[0:0]) */
    bit<13>     frag_offset;
    bit<8>      ttl;
    bit<8>      protocol;
    bit<16>     hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* The 32-byte AGG header (protocol.md section 2). */
header agg_t {
    bit<4>  version;
    bit<4>  pkt_type;
    bit<8>  flags;
    bit<16> job;
    bit<16> slot;
    bit<8>  worker;
    bit<8>  min_count;
    bit<32> round;
    bit<32> expected;
    bit<32> contributors;
    bit<32> tensor;
    bit<32> offset;
    bit<16> num_values;
    bit<8>  count;
    bit<8>  reserved;
}

/* One DATA payload byte: value 2k in the high nibble, value 2k+1 in the low nibble. */
header index_byte_t {
    bit<8> packed;
}

/* Four RESULT lanes (8-bit sums), lane 4k+i = byte i from the top: one register cell. */
header sum_word_t {
    bit<32> lanes;
}

struct headers_t {
    bridge_t                  bridge;
    ethernet_t                ethernet;
    ipv4_t                    ipv4;
    udp_t                     udp;
    agg_t                     agg;
    index_byte_t[INDEX_BYTES] idx;      /* ingress: DATA payload */
    sum_word_t[SUM_WORDS]     sums;     /* RESULT payload: ceil(num_values / 4) words */
}

/* Table values of two lanes per packed byte, one field per byte position. */
struct lane_pairs_t {
    bit<16> p0;  bit<16> p1;  bit<16> p2;  bit<16> p3;
    bit<16> p4;  bit<16> p5;  bit<16> p6;  bit<16> p7;
    bit<16> p8;  bit<16> p9;  bit<16> p10; bit<16> p11;
    bit<16> p12; bit<16> p13; bit<16> p14; bit<16> p15;
    bit<16> p16; bit<16> p17; bit<16> p18; bit<16> p19;
    bit<16> p20; bit<16> p21; bit<16> p22; bit<16> p23;
    bit<16> p24; bit<16> p25; bit<16> p26; bit<16> p27;
    bit<16> p28; bit<16> p29; bit<16> p30; bit<16> p31;
}

struct ingress_metadata_t {
    /* parser */
    bit<1>   to_agg;            /* UDP destination in the aggregation range, not a fragment */
    bit<1>   is_fragment;       /* IPv4 MF = 1 or fragment offset != 0 (rule R4) */
    bit<1>   agg_fragment;      /* a first fragment whose UDP destination is an AGG port */
    /* validation (validation.p4): inputs of the ordered checks (agg_checks, thc_ina.p4) */
    bit<2>   header_check;      /* HEADER_* from version and type */
    bit<1>   length_ok;         /* IPv4, UDP and payload lengths fit type and num_values */
    bit<1>   to_switch;         /* IPv4 destination is the aggregator's own address */
    bit<8>   expected_bits_a;   /* popcount of expected[31:21], [20:10], [9:0] */
    bit<8>   expected_bits_b;
    bit<8>   expected_bits_c;
    bit<8>   expected_bits_ab;  /* a + b: each add its own table, so each its own stage */
    bit<8>   expected_size;     /* popcount(expected) */
    bit<1>   too_few_expected;  /* min_count > popcount(expected) (rule R3) */
    bit<16>  slot_gap;          /* slot - pool_size: negative when the slot exists */
    bit<16>  values_gap;        /* values_per_packet - num_values: negative = too many */
    bit<8>   members_gap;       /* member_count - min_count: negative = unsatisfiable */
    bit<1>   expected_strays;   /* expected names a non-member (rule R3) */
    bit<1>   in_expected;       /* expected names the sender */
    bit<1>   accepted;          /* agg_checks passed: a member's valid DATA or FLUSH */
    /* job and membership (forwarding.p4) */
    bit<1>   job_known;
    job_index_t job_index;      /* the lookups' key: 16 x 256 entries index a table directly */
    bit<16>  counter_base;      /* job_index * JOB_COUNTER_STRIDE */
    slot_index_t slot_base;     /* first slot of the job in the slot registers */
    bit<16>  pool_size;
    bit<16>  values_per_packet; /* the job's limit (rule R7) */
    bit<8>   member_count;
    bit<16>  group;             /* multicast group of the job (job_index + 1) */
    bit<1>   is_member;
    bit<32>  worker_bit;        /* 1 << worker */
    /* slot state (aggregation.p4) */
    slot_index_t slot_index;
    copy_index_t copy_index;
    bit<8>   target_left;       /* target - 1: what the first contribution leaves to wait for
                                 * (target = min_count, or popcount(expected) without one) */
    bit<8>   was_occupied;      /* 0: the copy held no round (never used, or FLUSHed) */
    bit<32>  round_distance;    /* packet round - copy round (before this packet) */
    bit<1>   fresh;             /* new round in this copy (protocol.md 4.2 step 1) */
    bit<1>   same_round;        /* r == copy round, copy not empty (step 3) */
    bit<32>  already_seen;      /* seen bitmap & (1 << worker) before this packet */
    bit<8>   left_before;       /* contributions the copy still waited for before this packet */
    bit<3>   outcome;
    lane_pairs_t lanes;         /* table values of this packet (lookup.p4) */
    /* ordinary forwarding (forwarding.p4) */
    route_index_t    route_index;
    next_hop_index_t next_hop_base;
    bit<8>           next_hop_last;     /* number of next hops - 1 */
    bit<8>           next_hop_turn;
    next_hop_index_t next_hop_index;
    /* DLCP (dlcp.p4) */
    bit<1>   is_data;           /* data band: data_color's key (queue and deflection go
                                 * straight to ig_tm_md and the bridged header) */
    /* counters (counters.p4): exactly one of the two is counted per packet */
    bit<1>   count_job;
    bit<16>  job_counter_index;
    bit<8>   global_cell;
}

struct egress_metadata_t {
    bit<8>   dest_worker;       /* the member this copy is addressed to */
    bit<1>   full_checksum;     /* an aggregator-built packet: IPv4 checksum recomputed */
    bit<8>   contributors_a;    /* popcount of the contributors bytes */
    bit<8>   contributors_b;
    bit<8>   contributors_c;
    bit<8>   contributors_d;
    bit<8>   contributors_ab;
    bit<8>   contributors_cd;
    bit<1>   dest_in_sums;      /* contributors names the dest worker (else a late worker) */
    bit<32>  mark_threshold;    /* K[queue] in queue cells, below 2^31 */
    bit<32>  depth_room;        /* K - enq_qdepth: negative = above the threshold */
    bit<1>   dlcp_count;        /* the DLCP stage acted: count dlcp_cell once */
    bit<2>   dlcp_cell;
    bit<1>   ce_marked;         /* ECN set to CE here (rule R5 update for forwarded packets) */
    bit<16>  checksum_delta;    /* the ECN bits' increase when marking CE */
}

#endif
