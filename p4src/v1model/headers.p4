/* Headers, constants and metadata of the THC-INA v1model program.
 * Wire format: docs/protocol.md sections 1-2 (protocol version 2). */
#ifndef _THC_INA_HEADERS_P4_
#define _THC_INA_HEADERS_P4_

/* ---- resource limits of this target (p4src/v1model/README.md) ---- */
#define MAX_VALUES      64          /* values per packet (protocol.md section 8) */
#define MAX_FRAME       9216        /* longest frame taken; longer: drop_oversize (4.1) */
#define INDEX_BYTES     32          /* MAX_VALUES / 2 packed 4-bit indices */
#define SUM_WORDS       8           /* MAX_VALUES / 8: sums live in 64-bit words of 8 lanes */
#define MAX_JOBS        16
#define SLOT_BUDGET     4096        /* slots of all jobs together */
#define SLOT_COPIES     8192        /* two copies (round parity) per slot */
#define DLCP_PORTS      32          /* switch ports with DLCP queues (a power of two) */
#define DLCP_QUEUES     256         /* DLCP_PORTS x 8 priority queues */
#define DLCP_HISTORY    1024        /* > any BMv2 queue depth (a power of two) */

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<9>  port_id_t;

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8>  IP_PROTO_UDP   = 17;
const bit<16> AGG_PORT_BASE  = 50000;   /* UDP ports 50000-50015 (dport & 0xFFF0) */
const bit<16> AGG_PORT_MASK  = 0xFFF0;

const bit<4>  AGG_VERSION    = 2;
const bit<4>  TYPE_DATA      = 0;
const bit<4>  TYPE_RESULT    = 1;
const bit<4>  TYPE_STRAGGLER = 2;
const bit<4>  TYPE_FLUSH     = 3;
const bit<8>  FLAG_RESERVE   = 0x02;
const bit<8>  FLAG_LATE      = 0x04;

const bit<16> AGG_HEADER_LEN = 32;
const bit<16> UDP_HEADER_LEN = 8;
const bit<16> IPV4_HEADER_LEN = 20;
const bit<32> L2_TO_AGG_LEN  = 74;      /* Ethernet + IPv4 + UDP + AGG header */

/* DLCP admission verdicts (dlcp.p4) */
const bit<2> VERDICT_PASS           = 0;
const bit<2> VERDICT_MARK           = 1;  /* above K, ECT: CE mark */
const bit<2> VERDICT_SELECTIVE_DROP = 2;  /* above K, Not-ECT */
const bit<2> VERDICT_BUFFER_DROP    = 3;  /* at capacity */

/* Outcome of the slot state machine (protocol.md section 4.2). */
const bit<3> OUTCOME_PENDING      = 0;  /* aggregated, round not complete: consumed */
const bit<3> OUTCOME_COMPLETE     = 1;  /* aggregated and completed: multicast RESULT */
const bit<3> OUTCOME_DUPLICATE    = 2;  /* retransmission before completion: dropped */
const bit<3> OUTCOME_RESERVE      = 3;  /* retransmission after completion: unicast RESULT */
const bit<3> OUTCOME_RESERVE_LATE = 4;  /* non-contributor after partial completion */
const bit<3> OUTCOME_STRAGGLER    = 5;  /* obsolete round: STRAGGLER notice */

header ethernet_t {
    mac_addr_t dst_addr;
    mac_addr_t src_addr;
    bit<16>    ether_type;
}

header ipv4_t {
    bit<4>      version;
    bit<4>      ihl;
    bit<6>      dscp;           /* DLCP band */
    bit<2>      ecn;            /* DLCP importance: Not-ECT = unimportant */
    bit<16>     total_len;
    bit<16>     identification;
    bit<3>      flags;          /* reserved, DF, MF (flags[0:0]) */
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

/* One RESULT payload byte: an 8-bit lane sum. */
header sum_byte_t {
    bit<8> value;
}

struct headers_t {
    ethernet_t               ethernet;
    ipv4_t                   ipv4;
    udp_t                    udp;
    agg_t                    agg;
    index_byte_t[INDEX_BYTES] idx;
    sum_byte_t[MAX_VALUES]    sums;
}

/* Table values of two lanes per packed byte, one field per byte position
 * (v1model metadata cannot hold arrays). */
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

/* 64 lanes as eight 64-bit words; lane 8j+i is byte i (from the top) of word j. */
struct lane_words_t {
    bit<64> w0; bit<64> w1; bit<64> w2; bit<64> w3;
    bit<64> w4; bit<64> w5; bit<64> w6; bit<64> w7;
}

struct metadata_t {
    /* parser */
    bit<1>   to_agg_port;       /* UDP destination in the aggregation range */
    bit<16>  idx_bytes_left;    /* DATA payload bytes still to extract */
    /* job and membership (forwarding.p4) */
    bit<1>   job_known;
    bit<32>  job_index;         /* dense index: counters, multicast group job_index + 1 */
    bit<32>  slot_base;         /* first slot of the job in the shared slot registers */
    bit<16>  pool_size;
    bit<16>  values_per_packet; /* the job's limit (protocol.md 3), <= MAX_VALUES */
    bit<32>  member_mask;       /* bit w set for each member w */
    bit<8>   member_count;
    bit<1>   is_member;         /* (job, worker) from its port, MAC, IPv4, UDP port */
    bit<1>   unsatisfiable;     /* a DATA that could never complete (protocol.md 4.1) */
    bit<32>  worker_bit;        /* 1 << worker */
    /* aggregation (aggregation.p4) */
    bit<32>  copy_index;        /* register cell of (job, slot, round parity) */
    bit<3>   outcome;
    bit<32>  copy_round;
    bit<32>  bitmap;
    bit<8>   count;
    bit<32>  res_expected;      /* fields of the packet that completed the copy */
    bit<8>   res_min_count;
    bit<32>  res_tensor;
    bit<32>  res_offset;
    bit<16>  res_num_values;
    lane_pairs_t values;        /* table values of this packet (lookup.p4) */
    lane_words_t sums;          /* the copy's sums after this packet */
    /* emission */
    bit<1>   emit_agg;          /* this packet leaves as a RESULT or STRAGGLER */
    bit<1>   is_multicast;      /* RESULT replicated to the job; worker = egress_rid */
    bit<8>   dest_worker;
    bit<16>  out_payload_len;
    bit<1>   ipv4_changed;      /* recompute the IPv4 header checksum */
    /* DLCP (dlcp.p4) */
    bit<3>   queue;
    bit<1>   is_data;
}

#endif
