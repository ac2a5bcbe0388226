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

/* RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'): the checksum after one 16-bit word
 * changed from m to m'. No header length needed (IPv4 options included); a bad
 * checksum stays bad by as much (docs/protocol.md §1). */
static uint16_t checksum_update(uint16_t checksum, uint16_t old_word, uint16_t new_word)
{
	uint32_t sum = (uint16_t)~checksum + (uint32_t)(uint16_t)~old_word + new_word;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/* Serial-number order of rounds (§4.2): a is newer than b when the 32-bit
 * difference is nonzero and its top bit clear (2^31 apart counts as older). */
static inline int round_newer(uint32_t a, uint32_t b)
{
	uint32_t d = a - b;
	return d != 0 && (d >> 31) == 0;
}

/* ---- lane kernels ------------------------------------------------------- */

/* A slot keeps its sums split by nibble (agg_core.h, struct agg_copy): packed
 * byte j holds values 2j (high nibble) and 2j+1 (low nibble), which add into
 * sums[j] and sums[odd_at + j] (odd_at: the job's sums_odd). A table lookup of
 * 32 high or 32 low nibbles is then already 32 consecutive lanes: no shuffling
 * back into value order per contribution, only once per result
 * (agg_sums_to_values). */

static inline void add_pair_scalar(uint8_t *sums, uint32_t odd_at, const uint8_t *packed,
				   uint32_t j, const uint8_t *table, int store)
{
	uint8_t b = packed[j];
	uint8_t *even = sums + j, *odd = sums + odd_at + j;
	*even = (uint8_t)((store ? 0 : *even) + table[b >> 4]);
	*odd = (uint8_t)((store ? 0 : *odd) + table[b & 0x0f]);
}

/* The last byte of an odd num_values: its low nibble is padding, not a value. */
static inline void add_last_even(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
				 const uint8_t *table, int store)
{
	if (num_values & 1) {
		uint32_t j = num_values / 2;
		sums[j] = (uint8_t)((store ? 0 : sums[j]) + table[packed[j] >> 4]);
	}
}

/* Byte-wise add of 8 lanes without carries between them (each lane mod 256). */
static inline uint64_t add_bytes_swar(uint64_t x, uint64_t y)
{
	const uint64_t high = 0x8080808080808080ULL;
	return ((x & ~high) + (y & ~high)) ^ ((x ^ y) & high);
}

static inline void add_word_swar(uint8_t *lanes, uint64_t add)
{
	uint64_t acc;
	memcpy(&acc, lanes, 8);
	acc = add_bytes_swar(acc, add);
	memcpy(lanes, &acc, 8);
}

/* The portable kernel: one 256-entry lookup per packed byte gives both lanes;
 * eight lookups fill a 64-bit word of even and one of odd lanes, added with SWAR. */
void agg_add_lanes_lut(uint8_t *sums, uint32_t odd_at, const uint8_t *packed,
		       uint32_t num_values, const uint16_t *pair_lut, const uint8_t *table)
{
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 8 <= pairs; j += 8) {
		uint64_t even = 0, odd = 0;
		for (uint32_t k = 0; k < 8; k++) {
			uint16_t v = pair_lut[packed[j + k]];
			even |= (uint64_t)(v & 0xff) << (8 * k);
			odd |= (uint64_t)(v >> 8) << (8 * k);
		}
		add_word_swar(sums + j, even);
		add_word_swar(sums + odd_at + j, odd);
	}
	for (; j < pairs; j++) {
		uint16_t v = pair_lut[packed[j]];
		sums[j] = (uint8_t)(sums[j] + (v & 0xff));
		sums[odd_at + j] = (uint8_t)(sums[odd_at + j] + (v >> 8));
	}
	add_last_even(sums, packed, num_values, table, 0);
}

#ifndef __SSSE3__
static void lanes_scalar(uint8_t *sums, uint32_t odd_at, const uint8_t *packed,
			 uint32_t num_values, const uint8_t *table, int store)
{
	for (uint32_t j = 0; j < num_values / 2; j++)
		add_pair_scalar(sums, odd_at, packed, j, table, store);
	add_last_even(sums, packed, num_values, table, store);
}
#endif

static void sums_to_values_scalar(uint8_t *out, const uint8_t *sums, uint32_t odd_at,
				  uint32_t num_values)
{
	for (uint32_t j = 0; j < num_values / 2; j++) {
		out[2 * j] = sums[j];
		out[2 * j + 1] = sums[odd_at + j];
	}
	if (num_values & 1)
		out[num_values - 1] = sums[num_values / 2];
}

#ifdef __SSSE3__
/* 32 lanes per step: pshufb looks the 16-entry table up for 16 high and 16 low
 * nibbles at once; paddb wraps each lane mod 256 like the scalar kernel. */
static inline __attribute__((always_inline))
void lanes_ssse3(uint8_t *sums, uint32_t odd_at, const uint8_t *packed, uint32_t num_values,
		 const uint8_t *table, const int store)
{
	const __m128i t = _mm_loadu_si128((const __m128i *)table);
	const __m128i nibble = _mm_set1_epi8(0x0f);
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 16 <= pairs; j += 16) {
		__m128i b = _mm_loadu_si128((const __m128i *)(packed + j));
		__m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
		__m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(b, nibble));
		__m128i *even = (__m128i *)(sums + j), *odd = (__m128i *)(sums + odd_at + j);
		if (!store) {
			hi = _mm_add_epi8(_mm_loadu_si128(even), hi);
			lo = _mm_add_epi8(_mm_loadu_si128(odd), lo);
		}
		_mm_storeu_si128(even, hi);
		_mm_storeu_si128(odd, lo);
	}
	for (; j < pairs; j++)
		add_pair_scalar(sums, odd_at, packed, j, table, store);
	add_last_even(sums, packed, num_values, table, store);
}

static void sums_to_values_ssse3(uint8_t *out, const uint8_t *sums, uint32_t odd_at,
				 uint32_t num_values)
{
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 16 <= pairs; j += 16) {
		__m128i e = _mm_loadu_si128((const __m128i *)(sums + j));
		__m128i o = _mm_loadu_si128((const __m128i *)(sums + odd_at + j));
		_mm_storeu_si128((__m128i *)(out + 2 * j), _mm_unpacklo_epi8(e, o));
		_mm_storeu_si128((__m128i *)(out + 2 * j + 16), _mm_unpackhi_epi8(e, o));
	}
	sums_to_values_scalar(out + 2 * j, sums + j, odd_at, num_values - 2 * j);
}
#endif

#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same steps on 64 lanes (AVX2), chosen at run time where the CPU has it. */
__attribute__((target("avx2"), always_inline))
static inline void lanes_avx2(uint8_t *sums, uint32_t odd_at,
			      const uint8_t *packed, uint32_t num_values,
			      const uint8_t *table, const int store)
{
	const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
	const __m256i nibble = _mm256_set1_epi8(0x0f);
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 32 <= pairs; j += 32) {
		__m256i b = _mm256_loadu_si256((const __m256i *)(packed + j));
		__m256i hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
		__m256i lo = _mm256_shuffle_epi8(t, _mm256_and_si256(b, nibble));
		__m256i *even = (__m256i *)(sums + j), *odd = (__m256i *)(sums + odd_at + j);
		if (!store) {
			hi = _mm256_add_epi8(_mm256_loadu_si256(even), hi);
			lo = _mm256_add_epi8(_mm256_loadu_si256(odd), lo);
		}
		_mm256_storeu_si256(even, hi);
		_mm256_storeu_si256(odd, lo);
	}
	if (j < pairs || (num_values & 1))
		lanes_ssse3(sums + j, odd_at, packed + j, num_values - 2 * j, table, store);
}

__attribute__((target("avx2")))
static void add_lanes_avx2(uint8_t *sums, uint32_t odd_at,
			   const uint8_t *packed, uint32_t num_values,
			   const uint8_t *table)
{
	lanes_avx2(sums, odd_at, packed, num_values, table, 0);
}

__attribute__((target("avx2")))
static void store_lanes_avx2(uint8_t *sums, uint32_t odd_at,
			     const uint8_t *packed, uint32_t num_values,
			     const uint8_t *table)
{
	lanes_avx2(sums, odd_at, packed, num_values, table, 1);
}

/* unpack works per 128-bit half, so the two halves are put back in order. */
__attribute__((target("avx2")))
static void sums_to_values_avx2(uint8_t *out, const uint8_t *sums, uint32_t odd_at,
				uint32_t num_values)
{
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 32 <= pairs; j += 32) {
		__m256i e = _mm256_loadu_si256((const __m256i *)(sums + j));
		__m256i o = _mm256_loadu_si256((const __m256i *)(sums + odd_at + j));
		__m256i a = _mm256_unpacklo_epi8(e, o);   /* values 0-15 | 32-47 */
		__m256i c = _mm256_unpackhi_epi8(e, o);   /* values 16-31 | 48-63 */
		_mm256_storeu_si256((__m256i *)(out + 2 * j), _mm256_permute2x128_si256(a, c, 0x20));
		_mm256_storeu_si256((__m256i *)(out + 2 * j + 32), _mm256_permute2x128_si256(a, c, 0x31));
	}
	sums_to_values_ssse3(out + 2 * j, sums + j, odd_at, num_values - 2 * j);
}

/* 128 lanes per step where the CPU has AVX-512BW. */
__attribute__((target("avx512bw,avx2"), always_inline))
static inline void lanes_avx512(uint8_t *sums, uint32_t odd_at,
				const uint8_t *packed, uint32_t num_values,
				const uint8_t *table, const int store)
{
	const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
	const __m512i nibble = _mm512_set1_epi8(0x0f);
	uint32_t pairs = num_values / 2, j = 0;
	for (; j + 64 <= pairs; j += 64) {
		__m512i b = _mm512_loadu_si512((const void *)(packed + j));
		__m512i hi = _mm512_shuffle_epi8(t, _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble));
		__m512i lo = _mm512_shuffle_epi8(t, _mm512_and_si512(b, nibble));
		uint8_t *even = sums + j, *odd = sums + odd_at + j;
		if (!store) {
			hi = _mm512_add_epi8(_mm512_loadu_si512((const void *)even), hi);
			lo = _mm512_add_epi8(_mm512_loadu_si512((const void *)odd), lo);
		}
		_mm512_storeu_si512((void *)even, hi);
		_mm512_storeu_si512((void *)odd, lo);
	}
	if (j < pairs || (num_values & 1))
		lanes_avx2(sums + j, odd_at, packed + j, num_values - 2 * j, table, store);
}

__attribute__((target("avx512bw,avx2")))
static void add_lanes_avx512(uint8_t *sums, uint32_t odd_at,
			     const uint8_t *packed, uint32_t num_values,
			     const uint8_t *table)
{
	lanes_avx512(sums, odd_at, packed, num_values, table, 0);
}

__attribute__((target("avx512bw,avx2")))
static void store_lanes_avx512(uint8_t *sums, uint32_t odd_at,
			       const uint8_t *packed, uint32_t num_values,
			       const uint8_t *table)
{
	lanes_avx512(sums, odd_at, packed, num_values, table, 1);
}

enum simd_level { SIMD_SSSE3, SIMD_AVX2, SIMD_AVX512 };

static int simd_level = -1;

static __attribute__((noinline)) void detect_simd_level(void)
{
	__builtin_cpu_init();
	int level = __builtin_cpu_supports("avx512bw") ? SIMD_AVX512
		  : __builtin_cpu_supports("avx2") ? SIMD_AVX2 : SIMD_SSSE3;
	const char *cap = getenv("AGG_SIMD_MAX");  /* "ssse3" / "avx2": test the others */
	if (cap != NULL && !strcmp(cap, "ssse3"))
		level = SIMD_SSSE3;
	else if (cap != NULL && !strcmp(cap, "avx2") && level > SIMD_AVX2)
		level = SIMD_AVX2;
	simd_level = level;
}

/* Detected once; after that a load and a predictable branch per call. */
static inline enum simd_level cpu_simd_level(void)
{
	if (__builtin_expect(simd_level < 0, 0))
		detect_simd_level();
	return (enum simd_level)simd_level;
}
#endif

void agg_add_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		   const struct agg_job *job)
{
	const uint32_t odd_at = job->sums_odd;
#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
	switch (cpu_simd_level()) {
	case SIMD_AVX512: add_lanes_avx512(sums, odd_at, packed, num_values, job->table); return;
	case SIMD_AVX2: add_lanes_avx2(sums, odd_at, packed, num_values, job->table); return;
	default: lanes_ssse3(sums, odd_at, packed, num_values, job->table, 0); return;
	}
#elif defined(__SSSE3__)
	lanes_ssse3(sums, odd_at, packed, num_values, job->table, 0);
#else
	agg_add_lanes_lut(sums, odd_at, packed, num_values, job->pair_lut, job->table);
#endif
}

void agg_store_lanes(uint8_t *sums, const uint8_t *packed, uint32_t num_values,
		     const struct agg_job *job)
{
	const uint32_t odd_at = job->sums_odd;
#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
	switch (cpu_simd_level()) {
	case SIMD_AVX512: store_lanes_avx512(sums, odd_at, packed, num_values, job->table); return;
	case SIMD_AVX2: store_lanes_avx2(sums, odd_at, packed, num_values, job->table); return;
	default: lanes_ssse3(sums, odd_at, packed, num_values, job->table, 1); return;
	}
#elif defined(__SSSE3__)
	lanes_ssse3(sums, odd_at, packed, num_values, job->table, 1);
#else
	lanes_scalar(sums, odd_at, packed, num_values, job->table, 1);
#endif
}

void agg_sums_to_values(uint8_t *out, const uint8_t *sums, uint32_t odd_at, uint32_t num_values)
{
#if defined(__SSSE3__) && defined(__x86_64__) && defined(__GNUC__)
	if (cpu_simd_level() >= SIMD_AVX2)
		sums_to_values_avx2(out, sums, odd_at, num_values);
	else
		sums_to_values_ssse3(out, sums, odd_at, num_values);
#elif defined(__SSSE3__)
	sums_to_values_ssse3(out, sums, odd_at, num_values);
#else
	sums_to_values_scalar(out, sums, odd_at, num_values);
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
	/* 42 bytes as two fixed-size (overlapping) copies: a plain 42-byte memcpy
	 * compiles to rep movsb here, slow to start for so few bytes. */
	_Static_assert(AGG_L2L4_LEN > 32 && AGG_L2L4_LEN <= 48, "l2l4 copy sizes");
	memcpy(f, m->l2l4, 32);
	memcpy(f + AGG_L2L4_LEN - 16, m->l2l4 + AGG_L2L4_LEN - 16, 16);
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
		job->member_mask = 0;
		for (uint32_t w = 0; w < AGG_MAX_WORKERS; w++) {
			struct agg_member *m = &job->members[w];
			if (!m->valid)
				continue;
			job->member_ids[job->num_members++] = (uint8_t)w;
			job->member_mask |= 1u << w;
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

/* A whole RESULT frame built from a completed copy, addressed to worker w,
 * in the input's buffer when reuse is set and the emitter offers it. */
static uint8_t *emit_result(const struct agg_job *job, uint16_t slot,
			    const struct agg_copy *cp, uint8_t w, uint8_t flags, uint8_t tos,
			    const struct agg_emitter *em, int reuse)
{
	uint16_t port = job->members[w].port, len = (uint16_t)(AGG_MIN_FRAME + cp->num_values);
	uint8_t *f = NULL;
	if (reuse && em->reuse_input != NULL)
		f = em->reuse_input(em->ctx, port, len);
	if (f == NULL)
		f = em->alloc(em->ctx, port, len);
	if (f == NULL)
		return NULL;
	write_result_headers(job, slot, cp, w, flags, tos, f);
	agg_sums_to_values(f + AGG_MIN_FRAME, cp->sums, job->sums_odd, cp->num_values);
	return f;
}

/* The result to every member in worker-id order. The first frame is built
 * whole (in the completing packet's buffer where the emitter allows: every
 * field of the input has been read by now); every other member's is a copy of
 * it from the AGG header on (only the worker id differs there) behind that
 * member's own Ethernet/IPv4/UDP headers. */
static void multicast_result(const struct agg_job *job, uint16_t slot,
			     const struct agg_copy *cp, uint8_t tos, const struct agg_emitter *em)
{
	uint16_t udp_len = (uint16_t)(UDP_HLEN_ + AGG_HEADER_LEN + cp->num_values);
	uint16_t frame_len = (uint16_t)(AGG_MIN_FRAME + cp->num_values);
	const uint8_t *first = NULL;
	for (uint32_t i = 0; i < job->num_members; i++) {
		uint8_t w = job->member_ids[i];
		if (first == NULL) {
			first = emit_result(job, slot, cp, w, 0, tos, em, 1);
			continue;
		}
		const struct agg_member *m = &job->members[w];
		uint8_t *f = em->alloc(em->ctx, m->port, frame_len);
		if (f == NULL)
			continue;
		write_l2l4(m, f, tos, udp_len);
		memcpy(f + AGG_L2L4_LEN, first + AGG_L2L4_LEN, frame_len - AGG_L2L4_LEN);
		f[AGG_L2L4_LEN + H_WORKER] = w;
	}
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

/* ---- slot storage -------------------------------------------------------- */

uint32_t agg_sums_odd_for(uint32_t values_per_packet)
{
	/* Even values take ceil(n/2) lanes; the odd ones start at the next cache line. */
	return ((values_per_packet + 1) / 2 + 63) & ~63u;
}

int agg_job_alloc_slots(struct agg_job *job)
{
	job->sums_odd = agg_sums_odd_for(job->values_per_packet);
	job->copy_stride = sizeof(struct agg_copy) + 2 * (size_t)job->sums_odd;
	size_t bytes = (size_t)job->pool_size * 2 * job->copy_stride;
	/* calloc (lazily zeroed pages for large pools), aligned by hand for the
	 * 64-byte copies. */
	job->slots_mem = calloc(1, bytes + 63);
	if (job->slots_mem == NULL)
		return -1;
	job->slots = (uint8_t *)(((uintptr_t)job->slots_mem + 63) & ~(uintptr_t)63);
	return 0;
}

/* ---- the slot state machine (§4.2) -------------------------------------- */

/* Zero the lanes of values [from, to) in the split layout. */
static void zero_lanes(uint8_t *sums, uint32_t odd_at, uint32_t from, uint32_t to)
{
	uint32_t even_from = (from + 1) / 2, even_to = (to + 1) / 2;
	uint32_t odd_from = from / 2, odd_to = to / 2;
	memset(sums + even_from, 0, even_to - even_from);
	memset(sums + odd_at + odd_from, 0, odd_to - odd_from);
}

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
	struct agg_copy *cp = agg_copy_of(job, slot, r & 1);

	if (cp->bitmap == 0 || round_newer(r, cp->round)) {
		/* A new round in this copy: sums = 0 is folded into the first
		 * contribution below (it stores instead of adding). */
		cp->round = r;
		cp->bitmap = 0;
		cp->count = 0;
		cp->done = 0;
	} else if (r != cp->round) {
		job->c.straggler_notices++;
		emit_straggler(job, h, cp, w, tos, em);
		return;
	}

	if (cp->bitmap & bit) {
		if (cp->done) {
			job->c.results_reserved++;
			emit_result(job, slot, cp, w, AGG_FLAG_RESERVE, tos, em, 0);
		} else {
			job->c.drop_duplicate++;
		}
		return;
	}
	if (cp->done) {
		job->c.results_reserved++;
		emit_result(job, slot, cp, w, AGG_FLAG_RESERVE | AGG_FLAG_LATE, tos, em, 0);
		return;
	}

	uint16_t nv = rd16(h + H_NUM_VALUES);
	if (cp->bitmap == 0) {
		/* First contribution of the round: sums = its values. */
		agg_store_lanes(cp->sums, payload, nv, job);
		cp->extent = nv;
	} else {
		if (nv > cp->extent) {
			/* Lanes no earlier contribution reached start from 0. */
			zero_lanes(cp->sums, job->sums_odd, cp->extent, nv);
			cp->extent = nv;
		}
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
	/* Packet spraying: successive packets of the route take its next hops in turn. */
	struct agg_route *r = &sw->routes[idx];
	const struct agg_next_hop *hop = &r->hops[r->next_turn];
	r->next_turn = (uint8_t)(r->next_turn + 1 == r->num_hops ? 0 : r->next_turn + 1);
	memcpy(frame, hop->mac, 6);
	memcpy(frame + 6, sw->mac, 6);
	*out_port = hop->port;
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

#define IP_MF          0x2000u
#define IP_FRAG_OFFSET 0x1fffu

/* An IPv4 fragment (MF set or a nonzero offset), or 0 for anything else. */
static inline int is_ipv4_fragment(const uint8_t *frame, uint32_t len)
{
	return len >= ETH_HLEN_ + IPV4_HLEN_ && rd16(frame + 12) == 0x0800 &&
	       (frame[ETH_HLEN_] >> 4) == 4 && (rd16(frame + ETH_HLEN_ + 6) & (IP_MF | IP_FRAG_OFFSET));
}

/* A fragment aimed at the aggregator (§4.1): a first fragment that would be an
 * aggregation packet, or any fragment to the switch's own address (a non-first
 * fragment carries no UDP header to look at). */
static int fragment_for_aggregator(const struct agg_switch *sw, const uint8_t *frame,
				   uint32_t len)
{
	const uint8_t *ip = frame + ETH_HLEN_;
	if (rd32(ip + 16) == sw->ip)
		return 1;
	return (rd16(ip + 6) & IP_FRAG_OFFSET) == 0 && is_aggregation_packet(frame, len);
}

/* The member's whole address (§4.1, R2): the (job, worker) entry exists and the
 * packet came in on its port from its MAC, IPv4 address and UDP port. */
static inline int from_member(const struct agg_job *job, uint8_t w, uint16_t in_port,
			      const uint8_t *frame)
{
	if (w >= AGG_MAX_WORKERS)
		return 0;
	const struct agg_member *m = &job->members[w];
	const uint8_t *ip = frame + ETH_HLEN_;
	return m->valid && m->port == in_port && memcmp(frame + 6, m->mac, 6) == 0 &&
	       rd32(ip + 12) == m->ip && rd16(ip + IPV4_HLEN_) == m->udp_port;
}

/* A DATA that could never complete (§4.1, R3): expected names a non-member, or
 * min_count exceeds the workers who may contribute. */
static inline int unsatisfiable(const struct agg_job *job, uint32_t expected, uint8_t min_count)
{
	if (expected & ~job->member_mask)
		return 1;
	uint32_t can_contribute = expected ? (uint32_t)__builtin_popcount(expected)
					   : job->num_members;
	return min_count > can_contribute;
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
			return 0;   /* the job's own, lower limit is checked once it is known */
		return udp_len == UDP_HLEN_ + AGG_HEADER_LEN + (nv + 1u) / 2;
	}
	/* FLUSH: no payload. Its num_values is not checked (the reference does not). */
	return udp_len == UDP_HLEN_ + AGG_HEADER_LEN;
}

/* Only what keeps the address inside the slot table is checked: prefetching
 * for a frame that turns out invalid (or ordinary traffic) costs nothing. */
void agg_prefetch(const struct agg_switch *sw, const uint8_t *frame, uint32_t len)
{
	if (len < AGG_MIN_FRAME)
		return;
	const uint8_t *h = frame + AGG_L2L4_LEN;
	int32_t ji = sw->job_index[rd16(h + H_JOB)];
	if (ji < 0)
		return;
	const struct agg_job *job = &sw->jobs[ji];
	uint16_t slot = rd16(h + H_SLOT);
	if (slot >= job->pool_size)
		return;
	const struct agg_copy *cp = agg_copy_of(job, slot, h[H_ROUND + 3] & 1);
	/* The state, and the heads of the two streams the kernels walk (even and
	 * odd values): the hardware prefetcher follows on from there. */
	__builtin_prefetch(cp, 1);
	__builtin_prefetch(cp->sums, 1);
	__builtin_prefetch(cp->sums + job->sums_odd, 1);
}

enum agg_verdict agg_process(struct agg_switch *sw, uint16_t in_port, uint8_t *frame,
			     uint32_t len, const struct agg_emitter *em, uint16_t *out_port)
{
	if (len > AGG_MAX_WIRE_FRAME) {
		sw->g.drop_oversize++;
		return AGG_CONSUMED;
	}
	if (is_ipv4_fragment(frame, len)) {
		if (fragment_for_aggregator(sw, frame, len)) {
			sw->g.drop_fragment++;
			return AGG_CONSUMED;
		}
		return forward_ordinary(sw, frame, len, out_port);
	}
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
	if (type == AGG_TYPE_DATA && rd16(h + H_NUM_VALUES) > job->values_per_packet) {
		sw->g.drop_bad_length++;
		return AGG_CONSUMED;
	}
	uint16_t slot = rd16(h + H_SLOT);
	if (slot >= job->pool_size) {
		job->c.drop_bad_slot++;
		return AGG_CONSUMED;
	}
	uint8_t w = h[H_WORKER];
	if (!from_member(job, w, in_port, frame)) {
		job->c.drop_not_member++;
		return AGG_CONSUMED;
	}
	uint32_t expected = rd32(h + H_EXPECTED);
	if (type == AGG_TYPE_DATA) {
		if ((expected == 0 && h[H_MIN_COUNT] == 0) ||
		    (expected != 0 && !(expected & (1u << w)))) {
			job->c.drop_bad_expected++;
			return AGG_CONSUMED;
		}
		if (unsatisfiable(job, expected, h[H_MIN_COUNT])) {
			job->c.drop_unsatisfiable++;
			return AGG_CONSUMED;
		}
	}
	job->c.rx++;
	if (type == AGG_TYPE_FLUSH) {
		/* Both copies empty: the next DATA starts a round and stores its
		 * values, so stale sums need no clearing (extent does the rest). */
		for (uint32_t parity = 0; parity < 2; parity++)
			memset(agg_copy_of(job, slot, parity), 0, sizeof(struct agg_copy));
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
			uint16_t old_word = rd16(ip);
			ip[1] |= 3;
			wr16(ip + 10, checksum_update(rd16(ip + 10), old_word, rd16(ip)));
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
