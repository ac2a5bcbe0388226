/* SPDX-License-Identifier: BSD-3-Clause
 *
 * THC-INA switch core: validation, the slot state machine, result emission,
 * IPv4 forwarding and the DLCP egress stage of docs/protocol.md.
 */
#include <stdlib.h>
#include <string.h>

#include "agg_core.h"

#ifdef __SSSE3__
#include <tmmintrin.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the lane kernels assume a little-endian host"
#endif

/* ---- byte helpers (network byte order) ---------------------------------- */

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t rd32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v & 0xff; }
static inline void wr32(uint8_t *p, uint32_t v)
{
	p[0] = v >> 24; p[1] = (v >> 16) & 0xff; p[2] = (v >> 8) & 0xff; p[3] = v & 0xff;
}

static uint16_t ipv4_checksum(const uint8_t *ip)
{
	uint32_t sum = 0;
	for (int i = 0; i < 20; i += 2)
		if (i != 10)
			sum += rd16(ip + i);
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/* Offsets inside the AGG header (docs/protocol.md §2). */
enum {
	H_VER_TYPE = 0, H_FLAGS = 1, H_JOB = 2, H_SLOT = 4, H_WORKER = 6,
	H_MIN_COUNT = 7, H_ROUND = 8, H_EXPECTED = 12, H_CONTRIB = 16,
	H_TENSOR = 20, H_OFFSET = 24, H_NUM_VALUES = 28, H_COUNT = 30, H_RESERVED = 31,
};

/* ---- lane kernels ------------------------------------------------------- */

/* Byte-wise add of 8 lanes without carries between them (each lane mod 256). */
static inline uint64_t add_bytes_swar(uint64_t x, uint64_t y)
{
	const uint64_t high = 0x8080808080808080ULL;
	return ((x & ~high) + (y & ~high)) ^ ((x ^ y) & high);
}

static inline uint8_t table_value(const uint8_t *packed, uint32_t i, const uint8_t *table)
{
	uint8_t b = packed[i >> 1];
	return table[(i & 1) ? (b & 0x0f) : (b >> 4)];
}

/* The portable kernel: one 256-entry lookup per packed byte gives two lanes,
 * four lookups fill a 64-bit word of eight lanes added with SWAR. */
void agg_add_lanes_lut(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		       const uint16_t *pair_lut, const uint8_t *table)
{
	uint32_t i = 0;
	for (; i + 8 <= num_values; i += 8) {
		const uint8_t *p = packed + i / 2;
		uint64_t add = (uint64_t)pair_lut[p[0]] | (uint64_t)pair_lut[p[1]] << 16 |
			       (uint64_t)pair_lut[p[2]] << 32 | (uint64_t)pair_lut[p[3]] << 48;
		uint64_t acc;
		memcpy(&acc, sums + i, 8);
		acc = add_bytes_swar(acc, add);
		memcpy(sums + i, &acc, 8);
	}
	for (; i < num_values; i++)
		sums[i] = (uint8_t)(sums[i] + table_value(packed, i, table));
}

#ifdef __SSSE3__
/* 32 lanes per step: pshufb looks the 16-entry table up for 16 high and 16 low
 * nibbles at once, unpack interleaves them back into value order, paddb wraps
 * each lane mod 256 exactly like the scalar kernel. */
static inline __attribute__((always_inline))
void lanes_ssse3(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		 const uint8_t *table, const int store)
{
	const __m128i t = _mm_loadu_si128((const __m128i *)table);
	const __m128i nibble = _mm_set1_epi8(0x0f);
	uint32_t i = 0;
	for (; i + 32 <= num_values; i += 32) {
		__m128i b = _mm_loadu_si128((const __m128i *)(packed + i / 2));
		__m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
		__m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(b, nibble));
		__m128i v0 = _mm_unpacklo_epi8(hi, lo);
		__m128i v1 = _mm_unpackhi_epi8(hi, lo);
		__m128i *s = (__m128i *)(sums + i);
		if (!store) {
			v0 = _mm_add_epi8(_mm_loadu_si128(s), v0);
			v1 = _mm_add_epi8(_mm_loadu_si128(s + 1), v1);
		}
		_mm_storeu_si128(s, v0);
		_mm_storeu_si128(s + 1, v1);
	}
	for (; i < num_values; i++)
		sums[i] = (uint8_t)((store ? 0 : sums[i]) + table_value(packed, i, table));
}

static void add_lanes_ssse3(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
			    const uint8_t *table)
{
	lanes_ssse3(sums, packed, num_values, table, 0);
}

static void store_lanes_ssse3(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
			      const uint8_t *table)
{
	lanes_ssse3(sums, packed, num_values, table, 1);
}
#endif

#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same steps on 64 lanes (AVX2), chosen at run time where the CPU has it.
 * unpack works per 128-bit half, so the two halves are reordered with permute. */
__attribute__((target("avx2"), always_inline))
static inline void lanes_avx2(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
			      const uint8_t *table, const int store)
{
	const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
	const __m256i nibble = _mm256_set1_epi8(0x0f);
	uint32_t i = 0;
	for (; i + 64 <= num_values; i += 64) {
		__m256i b = _mm256_loadu_si256((const __m256i *)(packed + i / 2));
		__m256i hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
		__m256i lo = _mm256_shuffle_epi8(t, _mm256_and_si256(b, nibble));
		__m256i a = _mm256_unpacklo_epi8(hi, lo);   /* values 0-15 | 32-47 */
		__m256i c = _mm256_unpackhi_epi8(hi, lo);   /* values 16-31 | 48-63 */
		__m256i v0 = _mm256_permute2x128_si256(a, c, 0x20);
		__m256i v1 = _mm256_permute2x128_si256(a, c, 0x31);
		__m256i *s = (__m256i *)(sums + i);
		if (!store) {
			v0 = _mm256_add_epi8(_mm256_loadu_si256(s), v0);
			v1 = _mm256_add_epi8(_mm256_loadu_si256(s + 1), v1);
		}
		_mm256_storeu_si256(s, v0);
		_mm256_storeu_si256(s + 1, v1);
	}
	if (i < num_values)
		lanes_ssse3(sums + i, packed + i / 2, num_values - i, table, store);
}

__attribute__((target("avx2")))
static void add_lanes_avx2(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
			   const uint8_t *table)
{
	lanes_avx2(sums, packed, num_values, table, 0);
}

__attribute__((target("avx2")))
static void store_lanes_avx2(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
			     const uint8_t *table)
{
	lanes_avx2(sums, packed, num_values, table, 1);
}

static int cpu_has_avx2(void)
{
	static int has = -1;
	if (has < 0) {
		__builtin_cpu_init();
		has = __builtin_cpu_supports("avx2") ? 1 : 0;
	}
	return has;
}
#endif

void agg_add_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		   const struct agg_job *job)
{
#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
	if (cpu_has_avx2())
		add_lanes_avx2(sums, packed, num_values, job->table);
	else
		add_lanes_ssse3(sums, packed, num_values, job->table);
#elif defined(__SSSE3__)
	add_lanes_ssse3(sums, packed, num_values, job->table);
#else
	agg_add_lanes_lut(sums, packed, num_values, job->pair_lut, job->table);
#endif
}

void agg_store_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		     const struct agg_job *job)
{
#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
	if (cpu_has_avx2())
		store_lanes_avx2(sums, packed, num_values, job->table);
	else
		store_lanes_ssse3(sums, packed, num_values, job->table);
#elif defined(__SSSE3__)
	store_lanes_ssse3(sums, packed, num_values, job->table);
#else
	memset(sums, 0, num_values);
	agg_add_lanes_lut(sums, packed, num_values, job->pair_lut, job->table);
#endif
}

/* ---- emission ----------------------------------------------------------- */

/* Ethernet/IPv4/UDP headers of everything the switch emits (§5), from the
 * member's template: ToS, lengths and an incrementally completed checksum. */
static inline void write_l2l4(const struct agg_member *m, uint8_t *f, uint8_t tos,
			      uint16_t udp_len)
{
	uint16_t ip_len = (uint16_t)(IPV4_HLEN_ + udp_len);
	uint32_t sum = m->ip_csum_base + tos + ip_len;
	memcpy(f, m->l2l4, AGG_L2L4_LEN);
	uint8_t *ip = f + ETH_HLEN_;
	ip[1] = tos;
	wr16(ip + 2, ip_len);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	wr16(ip + 10, (uint16_t)~sum);
	wr16(ip + IPV4_HLEN_ + 4, udp_len);
}

void agg_switch_ready(struct agg_switch *sw)
{
	for (uint32_t j = 0; j < sw->num_jobs; j++) {
		struct agg_job *job = &sw->jobs[j];
		job->num_members = 0;
		for (uint32_t w = 0; w < AGG_MAX_WORKERS; w++) {
			struct agg_member *m = &job->members[w];
			if (!m->valid)
				continue;
			job->member_ids[job->num_members++] = (uint8_t)w;
			uint8_t *f = m->l2l4, *ip = f + ETH_HLEN_, *udp = ip + IPV4_HLEN_;
			memset(f, 0, AGG_L2L4_LEN);
			memcpy(f, m->mac, 6);
			memcpy(f + 6, sw->mac, 6);
			f[12] = 0x08;
			ip[0] = 0x45;
			wr16(ip + 6, 0x4000);       /* DF; identification 0 */
			ip[8] = 64;
			ip[9] = 17;
			wr32(ip + 12, sw->ip);
			wr32(ip + 16, m->ip);
			wr16(udp, AGG_PORT_BASE);
			wr16(udp + 2, m->udp_port);
			/* ToS, total length and checksum are 0 here: the base sum is the
			 * sum of the words that never change. */
			m->ip_csum_base = (uint16_t)~ipv4_checksum(ip);
		}
	}
}

/* The Ethernet/IPv4/UDP and AGG headers of a RESULT for worker w (§5.1). */
static void write_result_headers(const struct agg_job *job, uint16_t slot,
				 const struct agg_copy *cp, uint8_t w, uint8_t flags,
				 uint8_t tos, uint8_t *f)
{
	uint16_t udp_len = (uint16_t)(UDP_HLEN_ + AGG_HEADER_LEN + cp->num_values);
	write_l2l4(&job->members[w], f, tos, udp_len);
	uint8_t *h = f + AGG_L2L4_LEN;
	h[H_VER_TYPE] = AGG_VERSION << 4 | AGG_TYPE_RESULT;
	h[H_FLAGS] = flags;
	wr16(h + H_JOB, job->id);
	wr16(h + H_SLOT, slot);
	h[H_WORKER] = w;
	h[H_MIN_COUNT] = cp->min_count;
	wr32(h + H_ROUND, cp->round);
	wr32(h + H_EXPECTED, cp->expected);
	wr32(h + H_CONTRIB, cp->bitmap);
	wr32(h + H_TENSOR, cp->tensor);
	wr32(h + H_OFFSET, cp->offset);
	wr16(h + H_NUM_VALUES, cp->num_values);
	h[H_COUNT] = (uint8_t)__builtin_popcount(cp->bitmap);
	h[H_RESERVED] = 0;
}

/* A whole RESULT frame built from a completed copy, addressed to worker w. */
static void emit_result(const struct agg_job *job, uint16_t slot,
			const struct agg_copy *cp, uint8_t w, uint8_t flags, uint8_t tos,
			const struct agg_emitter *em)
{
	uint8_t *f = em->alloc(em->ctx, job->members[w].port,
			       (uint16_t)(AGG_MIN_FRAME + cp->num_values));
	if (f == NULL)
		return;
	write_result_headers(job, slot, cp, w, flags, tos, f);
	memcpy(f + AGG_MIN_FRAME, cp->sums, cp->num_values);
}

/* The result to every member in worker-id order: the sums are copied once and
 * shared when the emitter can chain a per-member header to them. */
static void multicast_result(const struct agg_job *job, uint16_t slot,
			     const struct agg_copy *cp, uint8_t tos, const struct agg_emitter *em)
{
	int shared = em->share != NULL && em->share(em->ctx, cp->sums, cp->num_values) == 0;
	for (uint32_t i = 0; i < job->num_members; i++) {
		uint8_t w = job->member_ids[i];
		if (!shared) {
			emit_result(job, slot, cp, w, 0, tos, em);
			continue;
		}
		uint8_t *f = em->alloc_header(em->ctx, job->members[w].port, AGG_MIN_FRAME);
		if (f != NULL)
			write_result_headers(job, slot, cp, w, 0, tos, f);
	}
	if (shared)
		em->unshare(em->ctx);
}

static void emit_straggler(const struct agg_job *job,
			   const uint8_t *rx_hdr, const struct agg_copy *cp, uint8_t w,
			   uint8_t tos, const struct agg_emitter *em)
{
	const struct agg_member *m = &job->members[w];
	uint16_t udp_len = UDP_HLEN_ + AGG_HEADER_LEN;
	uint8_t *f = em->alloc(em->ctx, m->port, (uint16_t)(ETH_HLEN_ + IPV4_HLEN_ + udp_len));
	if (f == NULL)
		return;
	write_l2l4(m, f, tos, udp_len);
	uint8_t *h = f + AGG_L2L4_LEN;
	memcpy(h, rx_hdr, AGG_HEADER_LEN);
	h[H_VER_TYPE] = AGG_VERSION << 4 | AGG_TYPE_STRAGGLER;
	wr32(h + H_ROUND, cp->round);
	wr32(h + H_CONTRIB, cp->bitmap);
	wr16(h + H_NUM_VALUES, 0);
	h[H_COUNT] = cp->count;
}

/* ---- the slot state machine (§4.2) -------------------------------------- */

static int copy_complete(const struct agg_copy *cp)
{
	if (cp->min_count > 0)
		return cp->count >= cp->min_count;
	return cp->bitmap == cp->expected;
}

static void process_data(struct agg_job *job, const uint8_t *h,
			 const uint8_t *payload, uint8_t tos, const struct agg_emitter *em)
{
	uint16_t slot = rd16(h + H_SLOT);
	uint8_t w = h[H_WORKER];
	uint32_t r = rd32(h + H_ROUND);
	uint32_t bit = 1u << w;
	struct agg_copy *cp = &job->slots[slot].copy[r & 1];

	if (r > cp->round || cp->bitmap == 0) {
		/* A new round in this copy: sums = 0 is folded into the first
		 * contribution below (it stores instead of adding). */
		cp->round = r;
		cp->bitmap = 0;
		cp->count = 0;
		cp->done = 0;
	} else if (r < cp->round) {
		job->c.straggler_notices++;
		emit_straggler(job, h, cp, w, tos, em);
		return;
	}

	if (cp->bitmap & bit) {
		if (cp->done) {
			job->c.results_reserved++;
			emit_result(job, slot, cp, w, AGG_FLAG_RESERVE, tos, em);
		} else {
			job->c.drop_duplicate++;
		}
		return;
	}
	if (cp->done) {
		job->c.results_reserved++;
		emit_result(job, slot, cp, w, AGG_FLAG_RESERVE | AGG_FLAG_LATE, tos, em);
		return;
	}

	uint16_t nv = rd16(h + H_NUM_VALUES);
	if (cp->bitmap == 0) {
		/* First contribution of the round: sums = its values, 0 past them. */
		agg_store_lanes(cp->sums, payload, nv, job);
		memset(cp->sums + nv, 0, AGG_MAX_VALUES - nv);
	} else {
		agg_add_lanes(cp->sums, payload, nv, job);
	}
	cp->bitmap |= bit;
	cp->count++;
	job->c.aggregated++;
	/* The completing packet's fields are the ones the result carries (§4.3). */
	cp->expected = rd32(h + H_EXPECTED);
	cp->min_count = h[H_MIN_COUNT];
	cp->tensor = rd32(h + H_TENSOR);
	cp->offset = rd32(h + H_OFFSET);
	cp->num_values = nv;
	if (!copy_complete(cp))
		return;
	cp->done = 1;
	job->c.results_multicast++;
	multicast_result(job, slot, cp, tos, em);
}

/* ---- forwarding of ordinary traffic (§7) -------------------------------- */

static int route_lookup_linear(const struct agg_switch *sw, uint32_t dst)
{
	/* routes[] is sorted by decreasing depth: the first match is the longest. */
	for (uint32_t i = 0; i < sw->num_routes; i++) {
		const struct agg_route *r = &sw->routes[i];
		uint32_t mask = r->depth ? ~0u << (32 - r->depth) : 0;
		if ((dst & mask) == r->prefix)
			return (int)i;
	}
	return -1;
}

static enum agg_verdict forward_ordinary(struct agg_switch *sw, uint8_t *frame, uint32_t len,
					 uint16_t *out_port)
{
	if (len < ETH_HLEN_ + IPV4_HLEN_ || rd16(frame + 12) != 0x0800 ||
	    (frame[ETH_HLEN_] >> 4) != 4) {
		sw->g.drop_not_routable++;
		return AGG_CONSUMED;
	}
	uint32_t dst = rd32(frame + ETH_HLEN_ + 16);
	int idx = sw->route_lookup ? sw->route_lookup(sw->route_ctx, dst)
				   : route_lookup_linear(sw, dst);
	if (idx < 0 || (uint32_t)idx >= sw->num_routes) {
		sw->g.drop_not_routable++;
		return AGG_CONSUMED;
	}
	const struct agg_route *r = &sw->routes[idx];
	memcpy(frame, r->mac, 6);
	memcpy(frame + 6, sw->mac, 6);
	*out_port = r->port;
	sw->g.forwarded++;
	return AGG_FORWARD;
}

/* ---- validation (§4.1) and dispatch -------------------------------------- */

static int is_aggregation_packet(const uint8_t *frame, uint32_t len)
{
	if (len < AGG_L2L4_LEN || rd16(frame + 12) != 0x0800)
		return 0;
	const uint8_t *ip = frame + ETH_HLEN_;
	if (ip[0] != 0x45 || ip[9] != 17)
		return 0;
	return (rd16(ip + IPV4_HLEN_ + 2) & AGG_PORT_MASK) == AGG_PORT_BASE;
}

/* Length rules: IPv4 total = 20 + UDP length, UDP length within the frame and
 * exactly what the type's payload needs. */
static int lengths_valid(const uint8_t *frame, uint32_t len, uint8_t type, uint16_t nv)
{
	const uint8_t *ip = frame + ETH_HLEN_;
	uint32_t udp_len = rd16(ip + IPV4_HLEN_ + 4);
	if (rd16(ip + 2) != IPV4_HLEN_ + udp_len)
		return 0;
	if (udp_len > len - ETH_HLEN_ - IPV4_HLEN_)
		return 0;
	if (type == AGG_TYPE_DATA) {
		if (nv == 0 || nv > AGG_MAX_VALUES)
			return 0;
		return udp_len == UDP_HLEN_ + AGG_HEADER_LEN + (nv + 1u) / 2;
	}
	/* FLUSH: no payload. Its num_values is not checked (the reference does not). */
	return udp_len == UDP_HLEN_ + AGG_HEADER_LEN;
}

void agg_prefetch(const struct agg_switch *sw, const uint8_t *frame, uint32_t len)
{
	if (len < AGG_MIN_FRAME || !is_aggregation_packet(frame, len))
		return;
	const uint8_t *h = frame + AGG_L2L4_LEN;
	int32_t ji = sw->job_index[rd16(h + H_JOB)];
	if (ji < 0)
		return;
	const struct agg_job *job = &sw->jobs[ji];
	uint16_t slot = rd16(h + H_SLOT);
	if (slot >= job->pool_size)
		return;
	const struct agg_copy *cp = &job->slots[slot].copy[h[H_ROUND + 3] & 1];
	__builtin_prefetch(cp, 1);
	__builtin_prefetch(cp->sums, 1);
}

enum agg_verdict agg_process(struct agg_switch *sw, uint16_t in_port, uint8_t *frame,
			     uint32_t len, const struct agg_emitter *em, uint16_t *out_port)
{
	if (!is_aggregation_packet(frame, len))
		return forward_ordinary(sw, frame, len, out_port);
	if (len < AGG_MIN_FRAME) {
		sw->g.drop_truncated++;
		return AGG_CONSUMED;
	}
	const uint8_t *h = frame + AGG_L2L4_LEN;
	if ((h[H_VER_TYPE] >> 4) != AGG_VERSION) {
		sw->g.drop_bad_version++;
		return AGG_CONSUMED;
	}
	uint8_t type = h[H_VER_TYPE] & 0x0f;
	if (type != AGG_TYPE_DATA && type != AGG_TYPE_FLUSH) {
		sw->g.drop_bad_type++;
		return AGG_CONSUMED;
	}
	if (!lengths_valid(frame, len, type, rd16(h + H_NUM_VALUES))) {
		sw->g.drop_bad_length++;
		return AGG_CONSUMED;
	}
	int32_t ji = sw->job_index[rd16(h + H_JOB)];
	if (ji < 0) {
		sw->g.drop_unknown_job++;
		return AGG_CONSUMED;
	}
	struct agg_job *job = &sw->jobs[ji];
	if (rd16(h + H_SLOT) >= job->pool_size) {
		job->c.drop_bad_slot++;
		return AGG_CONSUMED;
	}
	uint8_t w = h[H_WORKER];
	if (w >= AGG_MAX_WORKERS || !job->members[w].valid || job->members[w].port != in_port) {
		job->c.drop_not_member++;
		return AGG_CONSUMED;
	}
	uint32_t expected = rd32(h + H_EXPECTED);
	if (type == AGG_TYPE_DATA &&
	    ((expected == 0 && h[H_MIN_COUNT] == 0) ||
	     (expected != 0 && !(expected & (1u << w))))) {
		job->c.drop_bad_expected++;
		return AGG_CONSUMED;
	}
	job->c.rx++;
	if (type == AGG_TYPE_FLUSH) {
		memset(&job->slots[rd16(h + H_SLOT)], 0, sizeof(struct agg_slot));
		job->c.flushes++;
		return AGG_CONSUMED;
	}
	uint8_t tos = frame[ETH_HLEN_ + 1];
	process_data(job, h, h + AGG_HEADER_LEN, tos, em);
	return AGG_CONSUMED;
}

/* ---- DLCP egress (§6) --------------------------------------------------- */

int dlcp_port_init(struct dlcp_port *p, uint32_t ring_size, int unlimited)
{
	memset(p, 0, sizeof(*p));
	p->unlimited = unlimited;
	for (uint32_t q = 0; q < AGG_NUM_QUEUES; q++) {
		p->q[q].ring = calloc(ring_size, sizeof(void *));
		if (p->q[q].ring == NULL)
			return -1;
		p->q[q].cap = ring_size;
	}
	return 0;
}

void dlcp_port_free(struct dlcp_port *p)
{
	for (uint32_t q = 0; q < AGG_NUM_QUEUES; q++)
		free(p->q[q].ring);
	memset(p, 0, sizeof(*p));
}

int dlcp_enqueue(struct agg_switch *sw, struct dlcp_port *p, uint8_t *frame, uint32_t len,
		 void *pkt)
{
	int queue = dlcp_admit(sw, p, frame, len);
	if (queue < 0)
		return 0;
	struct dlcp_queue *q = &p->q[queue];
	q->ring[(q->head + q->count) % q->cap] = pkt;
	q->count++;
	p->queued++;
	return 1;
}

int dlcp_admit(struct agg_switch *sw, struct dlcp_port *p, uint8_t *frame, uint32_t len)
{
	struct agg_dscp_class cls = { 0, 0 };
	uint8_t *ip = frame + ETH_HLEN_;
	int ipv4 = len >= ETH_HLEN_ + IPV4_HLEN_ && rd16(frame + 12) == 0x0800;
	if (ipv4)
		cls = sw->dlcp.dscp[ip[1] >> 2];
	struct dlcp_queue *q = &p->q[cls.queue];
	/* An unlimited port sends every packet at once: it never has a backlog to
	 * admit against (only the ring itself can be full when the NIC stalls). */
	uint32_t occ = p->unlimited ? 0 : q->count;

	if (occ >= sw->dlcp.capacity || q->count >= q->cap) {
		sw->g.dlcp_buffer_drop++;
		return -1;
	}
	if (cls.is_data && occ > sw->dlcp.threshold[cls.queue]) {
		if ((ip[1] & 3) == 0) {
			sw->g.dlcp_selective_drop++;
			return -1;
		}
		if ((ip[1] & 3) != 3) {
			ip[1] |= 3;
			wr16(ip + 10, ipv4_checksum(ip));
			sw->g.dlcp_ce_marked++;
		}
	}
	return cls.queue;
}

void *dlcp_dequeue(struct dlcp_port *p)
{
	if (p->queued == 0)
		return NULL;
	for (int qi = AGG_NUM_QUEUES - 1; qi >= 0; qi--) {
		struct dlcp_queue *q = &p->q[qi];
		if (q->count == 0)
			continue;
		void *pkt = q->ring[q->head];
		q->head = (q->head + 1) % q->cap;
		q->count--;
		p->queued--;
		return pkt;
	}
	return NULL;
}

/* ---- statistics --------------------------------------------------------- */

void agg_write_stats_json(const struct agg_switch *sw, FILE *f, const char *extra)
{
	const char *sep = "";
	fprintf(f, "{\"global\": {");
#define PRINT_GLOBAL(name) fprintf(f, "%s\"" #name "\": %llu", sep, \
				   (unsigned long long)sw->g.name); sep = ", ";
	AGG_GLOBAL_COUNTERS(PRINT_GLOBAL)
#undef PRINT_GLOBAL
	fprintf(f, "}, \"jobs\": {");
	for (uint32_t j = 0; j < sw->num_jobs; j++) {
		const struct agg_job *job = &sw->jobs[j];
		sep = "";
		fprintf(f, "%s\"%u\": {", j ? ", " : "", job->id);
#define PRINT_JOB(name) fprintf(f, "%s\"" #name "\": %llu", sep, \
				(unsigned long long)job->c.name); sep = ", ";
		AGG_JOB_COUNTERS(PRINT_JOB)
#undef PRINT_JOB
		fprintf(f, "}");
	}
	fprintf(f, "}");
	if (extra != NULL && extra[0] != '\0')
		fprintf(f, ", %s", extra);
	fprintf(f, "}\n");
}
