/* SPDX-License-Identifier: BSD-3-Clause
 *
 * The switch's configuration file, written by dataplane/dpdk_config.py from a
 * dataplane.config.SwitchConfig. One directive per line, '#' starts a comment:
 *
 *   switch    <mac> <ipv4>
 *   capacity  <packets per (port, queue)>
 *   threshold <queue 0-7> <K>
 *   dscp      <dscp 0-63> <queue 0-7> <is_data 0|1>     (first one clears the default map)
 *   job       <id> <pool_size> <values_per_packet> <t0> ... <t15>
 *   member    <job> <worker> <port> <mac> <ipv4> <udp_port>
 *   route     <a.b.c.d/len> <port> <next-hop mac> [<port> <next-hop mac>]...
 *             (up to AGG_MAX_NEXT_HOPS equal-cost next hops, sprayed round-robin)
 *
 * Everything docs/protocol.md §3 says set-up refuses is refused here too, with a
 * message naming the line and what to change.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "agg_core.h"

#define MAX_LINE 1024
#define MAX_TOKENS 24

struct parse_ctx {
	struct agg_switch *sw;
	char *err;
	size_t errlen;
	int line;
	int dscp_map_seen;
};

static int fail(struct parse_ctx *c, const char *fmt, ...)
{
	va_list ap;
	int n = c->line ? snprintf(c->err, c->errlen, "config line %d: ", c->line) : 0;
	if (n < 0 || (size_t)n >= c->errlen)
		n = 0;
	va_start(ap, fmt);
	vsnprintf(c->err + n, c->errlen - n, fmt, ap);
	va_end(ap);
	return -1;
}

static int parse_uint(const char *s, unsigned long max, unsigned long *out)
{
	char *end;
	if (s == NULL || *s == '\0' || *s == '-')
		return -1;
	errno = 0;
	unsigned long v = strtoul(s, &end, 10);
	if (errno != 0 || *end != '\0' || v > max)
		return -1;
	*out = v;
	return 0;
}

static int parse_mac(const char *s, uint8_t mac[6])
{
	unsigned int b[6];
	char tail;
	if (s == NULL || sscanf(s, "%2x:%2x:%2x:%2x:%2x:%2x%c",
				&b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &tail) != 6)
		return -1;
	for (int i = 0; i < 6; i++)
		mac[i] = (uint8_t)b[i];
	return 0;
}

static int parse_ipv4(const char *s, uint32_t *ip)
{
	unsigned long part;
	char buf[32], *save = NULL, *tok;
	uint32_t v = 0;
	int n = 0;
	if (s == NULL || strlen(s) >= sizeof(buf))
		return -1;
	strcpy(buf, s);
	for (tok = strtok_r(buf, ".", &save); tok; tok = strtok_r(NULL, ".", &save)) {
		if (n == 4 || parse_uint(tok, 255, &part) < 0)
			return -1;
		v = v << 8 | (uint32_t)part;
		n++;
	}
	if (n != 4 || s[strlen(s) - 1] == '.')
		return -1;
	*ip = v;
	return 0;
}

static struct agg_job *find_job(struct agg_switch *sw, unsigned long id)
{
	int32_t i = sw->job_index[id];
	return i < 0 ? NULL : &sw->jobs[i];
}

static void note_port(struct agg_switch *sw, uint16_t port)
{
	if (port > sw->max_port)
		sw->max_port = port;
}

static int directive_switch(struct parse_ctx *c, char **t, int n)
{
	if (n != 3 || parse_mac(t[1], c->sw->mac) < 0 || parse_ipv4(t[2], &c->sw->ip) < 0)
		return fail(c, "expected 'switch <mac aa:bb:cc:dd:ee:ff> <ipv4>'");
	return 0;
}

static int directive_capacity(struct parse_ctx *c, char **t, int n)
{
	unsigned long v;
	if (n != 2 || parse_uint(t[1], 1u << 20, &v) < 0 || v < 1)
		return fail(c, "expected 'capacity <packets, 1..1048576>'");
	c->sw->dlcp.capacity = (uint32_t)v;
	return 0;
}

static int directive_threshold(struct parse_ctx *c, char **t, int n)
{
	unsigned long q, k;
	if (n != 3 || parse_uint(t[1], AGG_NUM_QUEUES - 1, &q) < 0 ||
	    parse_uint(t[2], 0xFFFFFFFFu, &k) < 0)
		return fail(c, "expected 'threshold <queue 0..7> <K 0..4294967295>'");
	c->sw->dlcp.threshold[q] = (uint32_t)k;
	return 0;
}

static int directive_dscp(struct parse_ctx *c, char **t, int n)
{
	unsigned long d, q, is_data;
	if (n != 4 || parse_uint(t[1], 63, &d) < 0 || parse_uint(t[2], AGG_NUM_QUEUES - 1, &q) < 0 ||
	    parse_uint(t[3], 1, &is_data) < 0)
		return fail(c, "expected 'dscp <0..63> <queue 0..7> <is_data 0|1>'");
	if (!c->dscp_map_seen) {
		memset(c->sw->dlcp.dscp, 0, sizeof(c->sw->dlcp.dscp));
		c->dscp_map_seen = 1;
	}
	c->sw->dlcp.dscp[d].queue = (uint8_t)q;
	c->sw->dlcp.dscp[d].is_data = (uint8_t)is_data;
	return 0;
}

static int directive_job(struct parse_ctx *c, char **t, int n)
{
	struct agg_switch *sw = c->sw;
	unsigned long id, pool, vpp, v;
	if (n != 4 + (int)AGG_TABLE_SIZE)
		return fail(c, "expected 'job <id> <pool_size> <values_per_packet> <16 table values>' "
			    "(a 4-bit table has 16 entries)");
	if (parse_uint(t[1], 0xFFFF, &id) < 0)
		return fail(c, "job id '%s' must be in 0..65535", t[1]);
	if (find_job(sw, id) != NULL)
		return fail(c, "two jobs share the id %lu; give each job its own id", id);
	if (parse_uint(t[2], AGG_MAX_SLOTS, &pool) < 0 || pool < 1)
		return fail(c, "job %lu: pool_size '%s' must be in 1..%u (this switch's slot budget)",
			    id, t[2], AGG_MAX_SLOTS);
	if (parse_uint(t[3], AGG_MAX_VALUES, &vpp) < 0 || vpp < 1)
		return fail(c, "job %lu: values_per_packet '%s' must be in 1..%u (this switch's limit "
			    "of values per packet); lower values_per_packet", id, t[3], AGG_MAX_VALUES);
	struct agg_job *jobs = realloc(sw->jobs, (sw->num_jobs + 1) * sizeof(*jobs));
	if (jobs == NULL)
		return fail(c, "out of memory");
	sw->jobs = jobs;
	struct agg_job *job = &jobs[sw->num_jobs];
	memset(job, 0, sizeof(*job));
	job->id = (uint16_t)id;
	job->pool_size = (uint32_t)pool;
	job->values_per_packet = (uint32_t)vpp;
	for (unsigned i = 0; i < AGG_TABLE_SIZE; i++) {
		if (parse_uint(t[4 + i], 255, &v) < 0)
			return fail(c, "job %lu: table value '%s' must be an integer in 0..255", id, t[4 + i]);
		job->table[i] = (uint8_t)v;
		if ((i == 0 && v != 0) || (i > 0 && v <= job->table[i - 1]))
			return fail(c, "job %lu: the table must start at 0 and strictly increase "
				    "(entry %u is %lu)", id, i, v);
	}
	for (unsigned b = 0; b < 256; b++)
		job->pair_lut[b] = (uint16_t)(job->table[b >> 4] | job->table[b & 15] << 8);
	if (agg_job_alloc_slots(job) < 0)
		return fail(c, "job %lu: cannot allocate %lu slots of %lu values; lower pool_size or "
			    "values_per_packet", id, pool, vpp);
	sw->job_index[id] = (int32_t)sw->num_jobs;
	sw->num_jobs++;
	return 0;
}

static int directive_member(struct parse_ctx *c, char **t, int n)
{
	unsigned long jid, w, port, udp;
	struct agg_member m = { .valid = 1 };
	if (n != 7)
		return fail(c, "expected 'member <job> <worker> <port> <mac> <ipv4> <udp_port>'");
	if (parse_uint(t[1], 0xFFFF, &jid) < 0 || find_job(c->sw, jid) == NULL)
		return fail(c, "member of job '%s', which no earlier 'job' line declares", t[1]);
	struct agg_job *job = find_job(c->sw, jid);
	if (parse_uint(t[2], AGG_MAX_WORKERS - 1, &w) < 0)
		return fail(c, "job %lu: worker id '%s' must be in 0..%u", jid, t[2], AGG_MAX_WORKERS - 1);
	if (job->members[w].valid)
		return fail(c, "job %lu: duplicate worker id %lu", jid, w);
	if (parse_uint(t[3], AGG_MAX_PORTS - 1, &port) < 0)
		return fail(c, "job %lu worker %lu: switch port '%s' must be in 0..%u",
			    jid, w, t[3], AGG_MAX_PORTS - 1);
	if (parse_mac(t[4], m.mac) < 0)
		return fail(c, "job %lu worker %lu: '%s' is not a MAC address", jid, w, t[4]);
	if (parse_ipv4(t[5], &m.ip) < 0)
		return fail(c, "job %lu worker %lu: '%s' is not an IPv4 address", jid, w, t[5]);
	if (parse_uint(t[6], 65535, &udp) < 0 || udp == 0)
		return fail(c, "job %lu worker %lu: UDP port '%s' must be in 1..65535", jid, w, t[6]);
	m.port = (uint16_t)port;
	m.udp_port = (uint16_t)udp;
	job->members[w] = m;
	job->num_members++;
	note_port(c->sw, m.port);
	return 0;
}

static int directive_route(struct parse_ctx *c, char **t, int n)
{
	struct agg_switch *sw = c->sw;
	struct agg_route r;
	unsigned long depth, port;
	char *slash = n >= 4 && n % 2 == 0 ? strchr(t[1], '/') : NULL;
	if (slash == NULL)
		return fail(c, "expected 'route <a.b.c.d/len> <port> <next-hop mac> "
			    "[<port> <next-hop mac>]...'");
	*slash = '\0';
	if (parse_ipv4(t[1], &r.prefix) < 0 || parse_uint(slash + 1, 32, &depth) < 0)
		return fail(c, "route '%s/%s' is not an IPv4 prefix", t[1], slash + 1);
	memset(r.hops, 0, sizeof(r.hops));
	r.num_hops = 0;
	r.next_turn = 0;
	for (int i = 2; i + 1 < n; i += 2) {
		if (r.num_hops == AGG_MAX_NEXT_HOPS)
			return fail(c, "route %s/%lu: more than %u next hops", t[1], depth,
				    AGG_MAX_NEXT_HOPS);
		struct agg_next_hop *hop = &r.hops[r.num_hops];
		if (parse_uint(t[i], AGG_MAX_PORTS - 1, &port) < 0)
			return fail(c, "route %s/%lu: port '%s' must be in 0..%u", t[1], depth,
				    t[i], AGG_MAX_PORTS - 1);
		if (parse_mac(t[i + 1], hop->mac) < 0)
			return fail(c, "route %s/%lu: '%s' is not a MAC address", t[1], depth,
				    t[i + 1]);
		hop->port = (uint16_t)port;
		r.num_hops++;
	}
	r.depth = (uint8_t)depth;
	r.prefix &= depth ? ~0u << (32 - depth) : 0;
	struct agg_route *routes = realloc(sw->routes, (sw->num_routes + 1) * sizeof(*routes));
	if (routes == NULL)
		return fail(c, "out of memory");
	/* Keep the list sorted by decreasing depth (stable): first match = longest. */
	uint32_t pos = sw->num_routes;
	while (pos > 0 && routes[pos - 1].depth < r.depth) {
		routes[pos] = routes[pos - 1];
		pos--;
	}
	routes[pos] = r;
	sw->routes = routes;
	sw->num_routes++;
	for (uint8_t i = 0; i < r.num_hops; i++)
		note_port(sw, r.hops[i].port);
	return 0;
}

static int parse_line(struct parse_ctx *c, char *line)
{
	char *t[MAX_TOKENS], *save = NULL;
	int n = 0;
	char *hash = strchr(line, '#');
	if (hash)
		*hash = '\0';
	for (char *tok = strtok_r(line, " \t\r\n", &save); tok; tok = strtok_r(NULL, " \t\r\n", &save)) {
		if (n == MAX_TOKENS)
			return fail(c, "too many fields");
		t[n++] = tok;
	}
	if (n == 0)
		return 0;
	if (!strcmp(t[0], "switch"))
		return directive_switch(c, t, n);
	if (!strcmp(t[0], "capacity"))
		return directive_capacity(c, t, n);
	if (!strcmp(t[0], "threshold"))
		return directive_threshold(c, t, n);
	if (!strcmp(t[0], "dscp"))
		return directive_dscp(c, t, n);
	if (!strcmp(t[0], "job"))
		return directive_job(c, t, n);
	if (!strcmp(t[0], "member"))
		return directive_member(c, t, n);
	if (!strcmp(t[0], "route"))
		return directive_route(c, t, n);
	return fail(c, "unknown directive '%s' (switch, capacity, threshold, dscp, job, member, route)",
		    t[0]);
}

/* A member is known by its address: two members of a job may not share one. */
static int check_addresses_distinct(struct parse_ctx *c, const struct agg_job *job)
{
	for (uint32_t a = 0; a < AGG_MAX_WORKERS; a++) {
		const struct agg_member *ma = &job->members[a];
		for (uint32_t b = a + 1; ma->valid && b < AGG_MAX_WORKERS; b++) {
			const struct agg_member *mb = &job->members[b];
			if (mb->valid && mb->ip == ma->ip && mb->udp_port == ma->udp_port)
				return fail(c, "job %u: workers %u and %u share the address "
					    "%u.%u.%u.%u:%u; a member is known by its (ip, udp_port), "
					    "give each worker its own udp_port", job->id, a, b,
					    ma->ip >> 24, (ma->ip >> 16) & 0xff, (ma->ip >> 8) & 0xff,
					    ma->ip & 0xff, ma->udp_port);
		}
	}
	return 0;
}

/* Rules that need the whole file: every job has members with distinct addresses,
 * lanes cannot overflow. */
static int check_jobs(struct parse_ctx *c)
{
	for (uint32_t j = 0; j < c->sw->num_jobs; j++) {
		const struct agg_job *job = &c->sw->jobs[j];
		unsigned g = job->table[AGG_TABLE_SIZE - 1];
		if (job->num_members == 0)
			return fail(c, "job %u has no members; add 'member' lines", job->id);
		if (check_addresses_distinct(c, job) < 0)
			return -1;
		if (job->num_members * g > AGG_LANE_MAX)
			return fail(c, "job %u: %u workers x granularity %u = %u overflows the 8-bit "
				    "result lanes (max %u); use granularity <= %u or at most %u workers",
				    job->id, job->num_members, g, job->num_members * g, AGG_LANE_MAX,
				    AGG_LANE_MAX / job->num_members, AGG_LANE_MAX / g);
	}
	return 0;
}

static void set_defaults(struct agg_switch *sw)
{
	/* docs/protocol.md §6 defaults: band b -> DSCP 32+b -> queue 6-b, CS6 -> 7. */
	for (unsigned b = 0; b < 7; b++) {
		sw->dlcp.dscp[32 + b].queue = (uint8_t)(6 - b);
		sw->dlcp.dscp[32 + b].is_data = 1;
		sw->dlcp.threshold[6 - b] = (uint32_t)(8.0 * (1 + 0.5 * b) + 0.5);
	}
	sw->dlcp.dscp[48].queue = 7;
	sw->dlcp.threshold[7] = 0xFFFF;
	sw->dlcp.capacity = 64;
}

int agg_config_parse(struct agg_switch *sw, FILE *f, char *err, size_t errlen)
{
	struct parse_ctx c = { .sw = sw, .err = err, .errlen = errlen };
	char line[MAX_LINE];

	memset(sw, 0, sizeof(*sw));
	sw->job_index = malloc(65536 * sizeof(int32_t));
	if (sw->job_index == NULL)
		return fail(&c, "out of memory");
	memset(sw->job_index, 0xff, 65536 * sizeof(int32_t));
	set_defaults(sw);
	while (fgets(line, sizeof(line), f) != NULL) {
		c.line++;
		if (strchr(line, '\n') == NULL && !feof(f))
			return fail(&c, "line longer than %d characters", MAX_LINE - 1);
		if (parse_line(&c, line) < 0)
			return -1;
	}
	c.line = 0;
	if (check_jobs(&c) < 0)
		return -1;
	agg_switch_ready(sw);
	return 0;
}

int agg_config_load(struct agg_switch *sw, const char *path, char *err, size_t errlen)
{
	FILE *f = fopen(path, "r");
	if (f == NULL) {
		memset(sw, 0, sizeof(*sw));
		snprintf(err, errlen, "cannot open config file %s: %s", path, strerror(errno));
		return -1;
	}
	int rc = agg_config_parse(sw, f, err, errlen);
	fclose(f);
	return rc;
}

void agg_switch_free(struct agg_switch *sw)
{
	for (uint32_t j = 0; j < sw->num_jobs; j++)
		free(sw->jobs[j].slots_mem);
	free(sw->jobs);
	free(sw->routes);
	free(sw->job_index);
	memset(sw, 0, sizeof(*sw));
}
