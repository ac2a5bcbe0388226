/* SPDX-License-Identifier: BSD-3-Clause
 *
 * THC-INA switch core: the wire protocol of docs/protocol.md (v2) on plain byte
 * buffers. Nothing here depends on DPDK, so the same code runs in the DPDK
 * application (main.c and the files of switch_app.h), in the sanitizer fuzz
 * harness (fuzz_harness.c) and in the benchmark (bench.c). The caller owns packet buffers; the core parses, validates, updates
 * slot state and writes the frames it emits into buffers the caller hands it.
 */
#ifndef AGG_CORE_H
#define AGG_CORE_H

#include <stdint.h>
#include <stdio.h>

#define AGG_VERSION        2
#define AGG_PORT_BASE      50000u
#define AGG_PORT_MASK      0xFFF0u
#define AGG_HEADER_LEN     32u
#define AGG_MAX_VALUES     8192u   /* a job's values_per_packet is at most this */
#define AGG_MAX_WORKERS    32u
#define AGG_MAX_SLOTS      65536u
#define AGG_MAX_PORTS      32u
#define AGG_NUM_QUEUES     8u
#define AGG_TABLE_SIZE     16u
#define AGG_LANE_MAX       255u

#define AGG_TYPE_DATA      0
#define AGG_TYPE_RESULT    1
#define AGG_TYPE_STRAGGLER 2
#define AGG_TYPE_FLUSH     3

#define AGG_FLAG_RETX      0x01
#define AGG_FLAG_RESERVE   0x02
#define AGG_FLAG_LATE      0x04

#define ETH_HLEN_          14u
#define IPV4_HLEN_         20u
#define UDP_HLEN_          8u
#define AGG_L2L4_LEN       (ETH_HLEN_ + IPV4_HLEN_ + UDP_HLEN_)   /* 42 */
#define AGG_MIN_FRAME      (AGG_L2L4_LEN + AGG_HEADER_LEN)        /* 74 */
#define AGG_MAX_FRAME      (AGG_MIN_FRAME + AGG_MAX_VALUES)       /* 8266: the largest RESULT */
/* MAX_FRAME of docs/protocol.md §4.1: a longer frame is dropped first (drop_oversize). */
#define AGG_MAX_WIRE_FRAME 9216u

/* Offsets inside the AGG header (docs/protocol.md §2). */
enum {
	H_VER_TYPE = 0, H_FLAGS = 1, H_JOB = 2, H_SLOT = 4, H_WORKER = 6,
	H_MIN_COUNT = 7, H_ROUND = 8, H_EXPECTED = 12, H_CONTRIB = 16,
	H_TENSOR = 20, H_OFFSET = 24, H_NUM_VALUES = 28, H_COUNT = 30, H_RESERVED = 31,
};

/* Per-job counters, docs/protocol.md §4.5 (names match the JSON keys). */
#define AGG_JOB_COUNTERS(X) \
	X(rx) X(aggregated) X(results_multicast) X(results_reserved) \
	X(straggler_notices) X(flushes) X(drop_bad_slot) X(drop_not_member) \
	X(drop_bad_expected) X(drop_unsatisfiable) X(drop_duplicate)

/* Global counters, docs/protocol.md §4.5. */
#define AGG_GLOBAL_COUNTERS(X) \
	X(drop_oversize) X(drop_fragment) X(drop_truncated) X(drop_bad_version) X(drop_bad_type) \
	X(drop_bad_length) X(drop_unknown_job) X(drop_not_routable) \
	X(dlcp_selective_drop) X(dlcp_buffer_drop) X(dlcp_ce_marked) X(forwarded)

#define AGG_DECLARE_COUNTER(name) uint64_t name;

struct agg_job_counters { AGG_JOB_COUNTERS(AGG_DECLARE_COUNTER) };
struct agg_global_counters { AGG_GLOBAL_COUNTERS(AGG_DECLARE_COUNTER) };

struct agg_member {
	uint8_t  valid;
	uint16_t port;          /* switch port the worker is attached to */
	uint8_t  mac[6];
	uint32_t ip;            /* host byte order */
	uint16_t udp_port;
	/* Everything this member receives starts with these Ethernet/IPv4/UDP bytes;
	 * only ToS, the lengths and the IPv4 checksum vary (filled by agg_switch_ready). */
	uint8_t  l2l4[AGG_L2L4_LEN];
	uint32_t ip_csum_base;  /* ones'-complement sum of the fixed IPv4 words */
};

/* One of the two copies of a slot (selected by round parity). The header fields
 * of the completing packet are kept so a re-serve can rebuild the result. A job's
 * copies lie copy_stride bytes apart, each followed by its sums. */
struct agg_copy {
	uint32_t round;
	uint32_t bitmap;
	uint32_t expected;
	uint32_t tensor;
	uint32_t offset;
	uint16_t num_values;
	uint8_t  count;
	uint8_t  done;
	uint8_t  min_count;
	/* Lanes [0, extent) hold this round's sums; the rest are stale and are
	 * zeroed only when a contribution reaches past them. */
	uint16_t extent;
	/* The job's values_per_packet lanes, split by nibble: value 2j's sum at
	 * sums[j], value 2j+1's at sums[job->sums_odd + j] (see the lane kernels;
	 * agg_sums_to_values gives value order). */
	uint8_t  sums[] __attribute__((aligned(64)));
};

struct agg_job {
	uint16_t id;
	uint32_t pool_size;
	uint32_t values_per_packet;   /* the most values a DATA of the job may carry */
	uint32_t sums_odd;      /* where a copy's odd values start (64-byte multiple) */
	size_t   copy_stride;   /* bytes from one copy to the next: header and sums */
	uint8_t  table[AGG_TABLE_SIZE];
	/* pair_lut[b]: the table values of both nibbles of packed byte b, the even
	 * value (high nibble) in the low byte: two 8-bit lanes per lookup. */
	uint16_t pair_lut[256];
	struct agg_member members[AGG_MAX_WORKERS];
	uint32_t num_members;
	uint32_t member_mask;                   /* bit w set for each member w */
	uint8_t  member_ids[AGG_MAX_WORKERS];   /* valid worker ids, ascending */
	/* 2 * pool_size copies of copy_stride bytes, 64-byte aligned inside
	 * slots_mem (calloc: untouched slots cost no memory until a round uses them). */
	uint8_t *slots;
	void    *slots_mem;
	struct agg_job_counters c;
};

/* Copy `parity` (round & 1) of a slot. */
static inline struct agg_copy *agg_copy_of(const struct agg_job *job, uint32_t slot,
					   uint32_t parity)
{
	return (struct agg_copy *)(job->slots + ((size_t)slot * 2 + parity) * job->copy_stride);
}

/* Storage of a job sized by its values_per_packet (sets sums_odd, copy_stride,
 * slots). Returns 0, or -1 when out of memory. */
int agg_job_alloc_slots(struct agg_job *job);

#define AGG_MAX_NEXT_HOPS  8u

struct agg_next_hop {
	uint16_t port;
	uint8_t  mac[6];
};

/* A route sprays its packets round-robin over its equal-cost next hops
 * (protocol.md 7): next_turn is the hop the next matching packet takes. */
struct agg_route {
	uint32_t prefix;        /* host byte order, masked */
	uint8_t  depth;
	uint8_t  num_hops;      /* 1..AGG_MAX_NEXT_HOPS */
	uint8_t  next_turn;     /* 0..num_hops-1, 0 at set-up */
	struct agg_next_hop hops[AGG_MAX_NEXT_HOPS];
};

struct agg_dscp_class {
	uint8_t queue;
	uint8_t is_data;
};

struct agg_dlcp_config {
	struct agg_dscp_class dscp[64];
	uint32_t threshold[AGG_NUM_QUEUES];
	uint32_t capacity;
};

/* Longest-prefix-match hook: returns the route index or -1. The DPDK app plugs
 * rte_lpm in; without a hook the core scans its (depth-sorted) route list. */
typedef int (*agg_route_lookup_fn)(void *ctx, uint32_t dst_ip);

struct agg_switch {
	uint8_t  mac[6];
	uint32_t ip;
	struct agg_job *jobs;
	uint32_t num_jobs;
	int32_t  *job_index;            /* 65536 entries: job id -> jobs[] index or -1 */
	struct agg_route *routes;
	uint32_t num_routes;
	struct agg_dlcp_config dlcp;
	uint16_t max_port;              /* highest port any member or route uses */
	agg_route_lookup_fn route_lookup;
	void *route_ctx;
	struct agg_global_counters g;
};

/* Where emitted frames go: alloc returns a writable buffer of len bytes that
 * leaves through port (or NULL when out of buffers: the emission is skipped). */
struct agg_emitter {
	uint8_t *(*alloc)(void *ctx, uint16_t port, uint16_t len);
	void *ctx;
	/* Optional (may be NULL or return NULL): the input frame's own buffer,
	 * resized to len, as an emission through port. The core asks for it only
	 * for the first frame of a multicast, after its last read of the input, so
	 * the buffer the completing packet arrived in carries the result out
	 * (hot in cache, one allocation less). The verdict is then AGG_CONSUMED
	 * and the caller must not free the input. */
	uint8_t *(*reuse_input)(void *ctx, uint16_t port, uint16_t len);
};

enum agg_verdict {
	AGG_CONSUMED = 0,   /* dropped or absorbed: the caller frees the input */
	AGG_FORWARD = 1,    /* rewritten in place, send it out of *out_port */
};

/* Config file (written by dataplane/dpdk_config.py). Returns 0, or -1 with a
 * message in err that says what to change. */
int agg_config_load(struct agg_switch *sw, const char *path, char *err, size_t errlen);
int agg_config_parse(struct agg_switch *sw, FILE *f, char *err, size_t errlen);
void agg_switch_free(struct agg_switch *sw);
/* Precompute per-member emission templates (called by agg_config_parse). */
void agg_switch_ready(struct agg_switch *sw);

/* Process one frame received on in_port. */
enum agg_verdict agg_process(struct agg_switch *sw, uint16_t in_port, uint8_t *frame,
			     uint32_t len, const struct agg_emitter *em, uint16_t *out_port);

/* Prefetch the slot copy a frame will touch (call a packet ahead, l3fwd style). */
void agg_prefetch(const struct agg_switch *sw, const uint8_t *frame, uint32_t len);

/* Lane kernels (exported so the fuzz harness can check they agree). They work
 * on the split layout of agg_copy.sums: even values in sums[0..], odd values
 * in sums[odd_at..] (a job's sums_odd). The SIMD level is the best the CPU
 * has, capped by the environment variable AGG_SIMD_MAX=ssse3|avx2 (to test
 * every level). */
void agg_add_lanes_lut(uint8_t *sums, uint32_t odd_at, const uint8_t *packed,
		       uint32_t num_values, const uint16_t *pair_lut, const uint8_t *table);
void agg_add_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		   const struct agg_job *job);
/* sums = T[idx] for the num_values values (a round's first contribution);
 * lanes past num_values are left alone. */
void agg_store_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		     const struct agg_job *job);
/* out[i] = value i's sum for i < num_values: split layout back to value order. */
void agg_sums_to_values(uint8_t *out, const uint8_t *sums, uint32_t odd_at,
			uint32_t num_values);
/* Where the odd values start for a job of values_per_packet values. */
uint32_t agg_sums_odd_for(uint32_t values_per_packet);

/* DLCP egress (docs/protocol.md §6): 8 strict-priority FIFOs per port. */
struct dlcp_queue {
	void   **ring;
	uint32_t head;
	uint32_t count;
	uint32_t cap;
};

struct dlcp_port {
	struct dlcp_queue q[AGG_NUM_QUEUES];
	uint32_t queued;            /* total over the 8 queues */
	int      unlimited;         /* no service-rate limit: admission sees no backlog */
};

/* ring_size: physical slots per queue (>= the configured capacity). */
int  dlcp_port_init(struct dlcp_port *p, uint32_t ring_size, int unlimited);
void dlcp_port_free(struct dlcp_port *p);
/* Admit pkt (whose frame bytes are frame/len) or drop it: returns 1 when
 * enqueued, 0 when the caller must free it. May CE-mark the frame in place. */
int  dlcp_enqueue(struct agg_switch *sw, struct dlcp_port *p, uint8_t *frame,
		  uint32_t len, void *pkt);
/* The admission decision alone (classification, drop, CE mark): the queue the
 * frame belongs to, or -1 when it is dropped. */
int  dlcp_admit(struct agg_switch *sw, struct dlcp_port *p, uint8_t *frame, uint32_t len);
/* Head of the highest non-empty queue, or NULL. */
void *dlcp_dequeue(struct dlcp_port *p);

/* JSON statistics: {"global": {...}, "jobs": {"id": {...}}}; extra is written
 * verbatim as further top-level members when non-NULL (e.g. "ports"). */
void agg_write_stats_json(const struct agg_switch *sw, FILE *f, const char *extra);

#endif
