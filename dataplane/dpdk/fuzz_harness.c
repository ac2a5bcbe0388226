/* SPDX-License-Identifier: BSD-3-Clause
 *
 * Sanitizer harness for the switch core (agg_core.c, agg_config.c), built with
 * ASan+UBSan and without DPDK (make fuzz):
 *
 *   build/fuzz_agg     libFuzzer: an input is one frame for the core, or (first
 *                      byte 'C') a config file for the parser.
 *   build/fuzz_replay  CONFIG CORPUS [CHECK]: runs every frame of CORPUS through one
 *                      switch (persistent state, like a real run), then the frames of
 *                      CHECK, printing what the CHECK frames emit as
 *                      "<port> <hex frame>" lines so a test can verify a valid round
 *                      still aggregates exactly after the garbage.
 *   Corpus/check files: records of <u32 little-endian length><u16 LE port><frame>.
 *
 * Besides memory safety, every frame checks invariants: emitted frames have the
 * length their headers claim, dropped packets change no slot, the SIMD and the
 * 256-entry lookup kernels agree and give value order back (run it with
 * AGG_SIMD_MAX=ssse3 or avx2 to check the lower SIMD levels too).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agg_core.h"

#define MAX_OUT 64

/* Room for the input frame, and for the largest RESULT written over it. */
#define FRAME_ROOM (AGG_MAX_FRAME + 64)

struct capture {
	uint8_t buf[MAX_OUT][AGG_MAX_FRAME];
	uint16_t len[MAX_OUT];
	uint16_t port[MAX_OUT];
	int n;
	uint8_t *input;         /* the frame being processed (FRAME_ROOM bytes) */
	int reused;             /* index of the emission in the input's buffer, or -1 */
};

static uint8_t *capture_alloc(void *ctx, uint16_t port, uint16_t len)
{
	struct capture *c = ctx;
	if (c->n == MAX_OUT || len > sizeof(c->buf[0]))
		abort();   /* the core never emits more than 32 frames of AGG_MAX_FRAME bytes */
	c->len[c->n] = len;
	c->port[c->n] = port;
	return c->buf[c->n++];
}

/* As the DPDK app does it: the input's own buffer carries the emission, its
 * bytes are captured after agg_process (any later read of the input by the
 * core would see the result being written over it). */
static uint8_t *capture_reuse_input(void *ctx, uint16_t port, uint16_t len)
{
	struct capture *c = ctx;
	if (c->reused >= 0 || c->n == MAX_OUT || len > sizeof(c->buf[0]))
		abort();   /* asked for twice, or more than the input's room */
	c->reused = c->n;
	c->len[c->n] = len;
	c->port[c->n] = port;
	c->n++;
	return c->input;
}

static const char FUZZ_CONFIG[] =
	"switch 02:00:00:00:00:fe 10.0.0.254\n"
	"capacity 4\n"
	"job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
	"member 1 0 0 02:00:00:00:01:01 10.0.1.17 41100\n"
	"member 1 1 1 02:00:00:00:01:02 10.0.1.18 41101\n"
	"member 1 5 1 02:00:00:00:01:06 10.0.1.22 41105\n"
	"job 2 2 40 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15\n"
	"member 2 3 2 02:00:00:00:02:04 10.0.2.36 41203\n"
	"route 10.0.0.0/8 2 02:00:00:00:00:aa\n"
	"route 10.1.0.0/16 3 02:00:00:00:00:bb 4 02:00:00:00:00:cc 5 02:00:00:00:00:dd\n";

static uint64_t slots_checksum(const struct agg_switch *sw)
{
	uint64_t h = 1469598103934665603ULL;
	for (uint32_t j = 0; j < sw->num_jobs; j++) {
		const uint8_t *p = sw->jobs[j].slots;
		size_t n = (size_t)sw->jobs[j].pool_size * 2 * sw->jobs[j].copy_stride;
		for (size_t i = 0; i < n; i++)
			h = (h ^ p[i]) * 1099511628211ULL;
	}
	return h;
}

static uint64_t counter_total(const struct agg_switch *sw, int drops_only)
{
	uint64_t t = 0;
#define ADD_DROP(name) if (!drops_only || !strncmp(#name, "drop_", 5)) t += sw->g.name;
	AGG_GLOBAL_COUNTERS(ADD_DROP)
#undef ADD_DROP
	for (uint32_t j = 0; j < sw->num_jobs; j++) {
#define ADD_JOB_DROP(name) if (!drops_only || !strncmp(#name, "drop_", 5)) t += sw->jobs[j].c.name;
		AGG_JOB_COUNTERS(ADD_JOB_DROP)
#undef ADD_JOB_DROP
	}
	return t;
}

static void check_emitted(const struct capture *c)
{
	for (int i = 0; i < c->n; i++) {
		const uint8_t *f = c->buf[i];
		uint32_t ip_len = (uint32_t)f[16] << 8 | f[17];
		uint32_t udp_len = (uint32_t)f[38] << 8 | f[39];
		if (c->len[i] != 14 + ip_len || ip_len != 20 + udp_len)
			abort();
	}
}

/* One frame through the core; aborts on a broken invariant. */
static void run_frame(struct agg_switch *sw, uint16_t port, const uint8_t *data, size_t size,
		      struct capture *cap)
{
	uint8_t frame[FRAME_ROOM];
	uint16_t out_port = 0xffff;
	if (size > sizeof(frame))
		size = sizeof(frame);
	memcpy(frame, data, size);
	uint64_t before = slots_checksum(sw), drops_before = counter_total(sw, 1);
	/* Odd-length frames are never reused, even ones may carry a result. */
	struct agg_emitter em = { capture_alloc, cap, size % 2 ? NULL : capture_reuse_input };
	cap->n = 0;
	cap->input = frame;
	cap->reused = -1;
	enum agg_verdict v = agg_process(sw, port, frame, (uint32_t)size, &em, &out_port);
	if (v == AGG_FORWARD && (out_port >= AGG_MAX_PORTS || cap->reused >= 0))
		abort();
	if (cap->reused >= 0)
		memcpy(cap->buf[cap->reused], frame, cap->len[cap->reused]);
	/* A dropped packet changes no slot and emits nothing. */
	if (counter_total(sw, 1) != drops_before && (slots_checksum(sw) != before || cap->n != 0))
		abort();
	check_emitted(cap);
}

/* The SIMD kernels against the lookup kernel on the job's split layout, and the
 * layout against value order: value i of the packed bytes adds T[nibble i]. */
static void check_kernels(const uint8_t *data, size_t size, const struct agg_job *job)
{
	static uint8_t a[AGG_MAX_VALUES], b[AGG_MAX_VALUES], values[AGG_MAX_VALUES];
	const uint32_t odd_at = job->sums_odd, max = job->values_per_packet;
	const size_t lanes = 2 * (size_t)odd_at;     /* one copy's sums */
	uint32_t nv = (uint32_t)(size * 2 > max ? max : size * 2);
	if (nv > 0 && (data[0] & 1))
		nv--;   /* odd counts too: the last byte's low nibble is padding */
	if (lanes > sizeof(a))
		abort();
	memset(a, 0x5a, lanes);
	memset(b, 0x5a, lanes);
	agg_add_lanes(a, data, nv, job);
	agg_add_lanes_lut(b, odd_at, data, nv, job->pair_lut, job->table);
	if (memcmp(a, b, lanes) != 0)
		abort();
	memset(values, 0xee, sizeof(values));
	agg_sums_to_values(values, a, odd_at, nv);
	for (uint32_t i = 0; i < AGG_MAX_VALUES; i++) {
		uint8_t want = 0xee;
		if (i < nv)
			want = (uint8_t)(0x5a + job->table[i & 1 ? data[i / 2] & 0x0f : data[i / 2] >> 4]);
		if (values[i] != want)
			abort();
	}
	/* store = add onto zeros, and leaves the lanes past num_values alone */
	memset(b, 0, (nv + 1) / 2);
	memset(b + odd_at, 0, nv / 2);
	agg_add_lanes_lut(b, odd_at, data, nv, job->pair_lut, job->table);
	agg_store_lanes(a, data, nv, job);
	if (memcmp(a, b, lanes) != 0)
		abort();
}

static struct agg_switch *fuzz_switch(const char *text)
{
	static struct agg_switch sw;
	static int ready;
	char err[256];
	if (ready)
		return &sw;
	FILE *f = fmemopen((void *)text, strlen(text), "r");
	if (f == NULL || agg_config_parse(&sw, f, err, sizeof(err)) != 0) {
		fprintf(stderr, "fuzz config refused: %s\n", err);
		abort();
	}
	fclose(f);
	ready = 1;
	return &sw;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct capture cap;
	if (size > 0 && data[0] == 'C') {
		/* The config parser: must refuse or accept, never misbehave. */
		struct agg_switch sw;
		char err[256];
		FILE *f = fmemopen((void *)(data + 1), size - 1 ? size - 1 : 1, "r");
		if (f == NULL)
			return 0;
		if (size > 1)
			agg_config_parse(&sw, f, err, sizeof(err));
		else
			memset(&sw, 0, sizeof(sw));
		fclose(f);
		agg_switch_free(&sw);
		return 0;
	}
	struct agg_switch *sw = fuzz_switch(FUZZ_CONFIG);
	uint16_t port = size > 0 ? data[size - 1] % 4 : 0;
	run_frame(sw, port, data, size, &cap);
	check_kernels(data, size, &sw->jobs[0]);
	return 0;
}

#ifdef FUZZ_REPLAY_MAIN
static uint8_t *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	if (f == NULL) {
		perror(path);
		exit(2);
	}
	fseek(f, 0, SEEK_END);
	*len = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	uint8_t *buf = malloc(*len ? *len : 1);
	if (buf == NULL || fread(buf, 1, *len, f) != *len) {
		perror(path);
		exit(2);
	}
	fclose(f);
	return buf;
}

/* Runs each record; prints the emissions when print is set. Returns frames run. */
static size_t replay(struct agg_switch *sw, const char *path, int print)
{
	static struct capture cap;
	size_t len, pos = 0, n = 0;
	uint8_t *buf = read_file(path, &len);
	while (pos + 6 <= len) {
		uint32_t flen = (uint32_t)buf[pos] | (uint32_t)buf[pos + 1] << 8 |
				(uint32_t)buf[pos + 2] << 16 | (uint32_t)buf[pos + 3] << 24;
		uint16_t port = (uint16_t)(buf[pos + 4] | buf[pos + 5] << 8);
		pos += 6;
		if (flen > len - pos) {
			fprintf(stderr, "%s: truncated record at %zu\n", path, pos);
			exit(2);
		}
		/* An exact-size heap copy so ASan catches any read past the frame. */
		uint8_t *frame = malloc(flen ? flen : 1);
		memcpy(frame, buf + pos, flen);
		run_frame(sw, port, frame, flen, &cap);
		if (flen > 0 && sw->num_jobs > 0)
			check_kernels(frame, flen, &sw->jobs[0]);
		free(frame);
		pos += flen;
		n++;
		for (int i = 0; print && i < cap.n; i++) {
			printf("%u ", cap.port[i]);
			for (int k = 0; k < cap.len[i]; k++)
				printf("%02x", cap.buf[i][k]);
			printf("\n");
		}
	}
	free(buf);
	return n;
}

int main(int argc, char **argv)
{
	struct agg_switch sw;
	char err[512];
	if (argc < 3) {
		fprintf(stderr, "usage: %s CONFIG CORPUS [CHECK]\n", argv[0]);
		return 2;
	}
	if (agg_config_load(&sw, argv[1], err, sizeof(err)) != 0) {
		fprintf(stderr, "refusing configuration %s: %s\n", argv[1], err);
		return 2;
	}
	size_t n = replay(&sw, argv[2], 0);
	fprintf(stderr, "replayed %zu frames\n", n);
	if (argc > 3)
		replay(&sw, argv[3], 1);
	agg_write_stats_json(&sw, stderr, NULL);
	agg_switch_free(&sw);
	return 0;
}
#endif
