/* The worker's data path of the in-network THC allreduce, in C.
 *
 * One call (dp_run) drives the window of one tensor stream of host/transport.py
 * (TensorStream, _Exchange) with the stream's own numpy arrays: take in RESULT datagrams
 * (recvmmsg) and scatter their payloads, send the DATA datagrams the window allows and
 * retransmit late ones (sendmmsg), follow the retransmission timer, and wait (ppoll) until
 * a prefix of the tensor's chunks is done. It does, step by step, what the Python path
 * (AggregatorTransport._round/_drive, host/datagram.py) does, so the datagrams on the wire
 * are the same; docs/protocol.md gives the header layout (§2) and the window rules (§4.4).
 * Python calls it through ctypes (host/native/__init__.py), which releases the GIL.
 *
 * What it does not handle it hands back as a status: a STRAGGLER notice (the rows from
 * it on are left in the receive rows), a stream waiting for input, no progress within
 * the timeout, an error from the kernel (errno), and input on the stream's wake-up pipe
 * (wake_fd: a background I/O thread's stream got new values, a new waiter, or closed),
 * and the caller's time limit passing (until: a bounded-loss rule's grace period).
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

enum { DP_DONE = 0, DP_NOTICE = 1, DP_WAITING_INPUT = 2, DP_TIMEOUT = 3, DP_ERRNO = 4,
       DP_WOKEN = 5, DP_DEADLINE = 6 };

#define HEADER_LEN 32
#define VERSION 2
#define TYPE_RESULT 1
#define TYPE_STRAGGLER 2
#define FLAG_RETX 0x01
#define SEND_BATCH 256          /* datagrams per sendmmsg call */
#define MAX_BACKOFF 64.0
#define FULL_BUFFER_WAIT_MS 50  /* as host/datagram.py's wait_writable(0.05) */
#define CWND_MIN 2.0            /* the CE window never closes below two chunks */
#define ECN_CE 3

/* The state of one stream; host/native/__init__.py mirrors it field by field (every field
 * 8 bytes wide, so there is no padding to agree on). */
struct dp_stream {
    /* the socket and the stream's arrays */
    int64_t fd, pool, n_chunks, num_values, vpp, job, tensor, row_width;
    uint8_t *rows;               /* DATA datagrams, row c = chunk c */
    int64_t *lengths;
    uint8_t *tos;
    int64_t *rounds;
    uint8_t *sent, *done, *retransmitted;
    double *sent_at, *deadline, *backoff;
    uint8_t *sums;
    int64_t *counts;
    uint32_t *contributors;
    int64_t *probed;
    uint8_t *rx;                 /* receive rows: rx_rows x rx_width bytes */
    int64_t rx_rows, rx_width;
    int64_t *rx_len;
    double *rtt_out;             /* RTT samples of this call */
    int64_t rtt_cap;
    /* scalars read and written back */
    int64_t available, next_unsent, n_done, done_prefix;
    double ex_last_progress, stream_last_progress;
    int64_t have_srtt;
    double srtt, rttvar, rto_init, rto_min, rto_max, timeout;
    int64_t sock_tos, ect_retx, heard;
    int64_t wake_fd;             /* -1, or a pipe whose input ends a blocking call */
    double moderation;           /* seconds RESULTs may gather (moderation_pause) */
    double until;                /* a blocking call ends here (monotonic s; INFINITY: never) */
    /* the CE window (AggregatorTransport._window_update): read and written back */
    uint8_t *rx_tos;             /* ToS byte of each receive row (IP_RECVTOS) */
    double cwnd;                 /* chunks this worker may have in flight (<= pool) */
    double cwnd_hold_until;      /* no second halving before this (monotonic s) */
    double cwnd_increase;        /* chunks added per window of unmarked RESULTs */
    int64_t ce_window;           /* react to CE-marked RESULTs */
    /* a grace period the loop starts itself (TensorStream.wait_grace): read and written */
    int64_t grace_at;            /* once this many chunks are done (-1: none; -2: started) */
    double grace_rtos;           /* ... `until` becomes now + this many RTOs at most */
    int64_t stall_all;           /* a stall re-sends every expired chunk (a grace period) */
    /* counters of this call */
    int64_t packets_sent, bytes_sent, retransmissions, packets_received, bytes_received,
            results_accepted, duplicates, ignored, send_calls, send_messages, recv_calls,
            rx_truncated, rtt_count, ce_results, window_cuts;
    /* what a status refers to */
    int64_t rx_next, rx_count, err;
};

/* Scratch memory of one call. */
struct scratch {
    int64_t *chunks;             /* n_chunks entries: the chunks of one send */
    struct mmsghdr *tx;          /* SEND_BATCH entries */
    struct iovec *tx_iov;
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } *tx_control;
    struct mmsghdr *rx;          /* rx_rows entries */
    struct iovec *rx_iov;
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } *rx_control;
};

static double monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint16_t be16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return be16toh(v); }
static uint32_t be32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return be32toh(v); }

/* Jacobson/Karels, as host/transport.py's RetransmitTimer. */
static double rto_of(const struct dp_stream *s)
{
    if (!s->have_srtt)
        return s->rto_init;
    return fmin(s->rto_max, fmax(s->rto_min, s->srtt + 4.0 * s->rttvar));
}

static void rtt_sample(struct dp_stream *s, double rtt)
{
    if (!s->have_srtt) {
        s->srtt = rtt;
        s->rttvar = rtt / 2.0;
        s->have_srtt = 1;
    } else {
        s->rttvar = 0.75 * s->rttvar + 0.25 * fabs(s->srtt - rtt);
        s->srtt = 0.875 * s->srtt + 0.125 * rtt;
    }
    if (s->rtt_count < s->rtt_cap)
        s->rtt_out[s->rtt_count] = rtt;
    s->rtt_count++;
}

static int64_t done_prefix(struct dp_stream *s)
{
    int64_t p = s->done_prefix;
    while (p < s->n_chunks && s->done[p])
        p++;
    /* Read while the call runs by a polling thread (host/transport.py, values_done), so
     * stored once, after the sums it covers. */
    __atomic_store_n(&s->done_prefix, p, __ATOMIC_RELEASE);
    return p;
}

/* Every chunk ever sent is below this bound (a chunk goes out only within pool of
 * next_unsent), so the in-flight scans stop there. */
static int64_t sent_bound(const struct dp_stream *s)
{
    int64_t hi = s->next_unsent + s->pool;
    return hi < s->n_chunks ? hi : s->n_chunks;
}

static struct timespec timespec_of(double seconds)
{
    struct timespec ts;
    if (seconds < 0)
        seconds = 0;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    return ts;
}

static int wait_fd(int fd, short events, double seconds)
{
    struct pollfd p = { .fd = fd, .events = events };
    struct timespec ts = timespec_of(seconds);
    return ppoll(&p, 1, &ts, NULL);
}

/* Wait for input on the socket or the wake-up pipe; 1 when the pipe has input (it is
 * left there for Python to read), 0 otherwise, -1 with errno on an error. */
static int wait_input(const struct dp_stream *s, double seconds)
{
    if (s->wake_fd < 0)
        return wait_fd((int)s->fd, POLLIN, seconds) < 0 ? -1 : 0;
    struct pollfd p[2] = { { .fd = (int)s->fd, .events = POLLIN },
                           { .fd = (int)s->wake_fd, .events = POLLIN } };
    struct timespec ts = timespec_of(seconds);
    if (ppoll(p, 2, &ts, NULL) < 0)
        return -1;
    return (p[1].revents & POLLIN) != 0;
}

/* ------------------------------------------------------------------ sending */

/* sendmmsg until all k messages are out, waiting while the socket buffer is full.
 * 0, or an errno. */
static int sendmmsg_all(struct dp_stream *s, struct mmsghdr *msgs, unsigned k)
{
    unsigned pos = 0;
    while (pos < k) {
        s->send_calls++;
        int sent = sendmmsg((int)s->fd, msgs + pos, k - pos, 0);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EINTR) {
                wait_fd((int)s->fd, POLLOUT, FULL_BUFFER_WAIT_MS * 1e-3);
                continue;
            }
            return errno;
        }
        pos += (unsigned)sent;
        s->send_messages += sent;
    }
    return 0;
}

/* Send rows chunks[0..k) in order. One ToS for all: set on the socket (when it changed);
 * else an IP_TOS control message per datagram (host/datagram.py, DatagramSocket.send). */
static int send_chunks(struct dp_stream *s, struct scratch *m, const int64_t *chunks, int64_t k)
{
    if (k == 0)
        return 0;
    int uniform = 1;
    for (int64_t i = 1; i < k && uniform; i++)
        uniform = s->tos[chunks[i]] == s->tos[chunks[0]];
    if (uniform && s->tos[chunks[0]] != s->sock_tos) {
        int tos = s->tos[chunks[0]];
        if (setsockopt((int)s->fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos) < 0)
            return errno;
        s->sock_tos = tos;
    }
    for (int64_t lo = 0; lo < k; lo += SEND_BATCH) {
        unsigned n = (unsigned)(k - lo < SEND_BATCH ? k - lo : SEND_BATCH);
        memset(m->tx, 0, n * sizeof *m->tx);
        for (unsigned i = 0; i < n; i++) {
            int64_t c = chunks[lo + i];
            m->tx_iov[i].iov_base = s->rows + c * s->row_width;
            m->tx_iov[i].iov_len = (size_t)s->lengths[c];
            m->tx[i].msg_hdr.msg_iov = &m->tx_iov[i];
            m->tx[i].msg_hdr.msg_iovlen = 1;
            s->bytes_sent += s->lengths[c];
            if (uniform)
                continue;
            struct cmsghdr *cm = (struct cmsghdr *)m->tx_control[i].buf;
            int tos = s->tos[c];
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            cm->cmsg_level = IPPROTO_IP;
            cm->cmsg_type = IP_TOS;
            memcpy(CMSG_DATA(cm), &tos, sizeof tos);
            m->tx[i].msg_hdr.msg_control = m->tx_control[i].buf;
            m->tx[i].msg_hdr.msg_controllen = CMSG_SPACE(sizeof(int));
        }
        int err = sendmmsg_all(s, m->tx, n);
        if (err)
            return err;
        s->packets_sent += n;
    }
    return 0;
}

/* Chunks in flight: sent, no result yet. */
static int64_t outstanding(const struct dp_stream *s)
{
    int64_t n = 0;
    for (int64_t c = s->done_prefix, hi = sent_bound(s); c < hi; c++)
        n += s->sent[c] && !s->done[c];
    return n;
}

/* How many more chunks the CE window lets out (AggregatorTransport._window_room): the
 * pool bounds the flight anyway, so an open window costs no scan. */
static int64_t window_room(const struct dp_stream *s)
{
    if (!s->ce_window || s->cwnd >= (double)s->pool)
        return s->pool;
    int64_t room = (int64_t)s->cwnd - outstanding(s);
    return room > 0 ? room : 0;
}

/* The CE response (AggregatorTransport._window_update): a batch with a CE-marked RESULT
 * halves the window, at most once per smoothed RTT (the marks of one queue build-up
 * arrive together); unmarked RESULTs open it by cwnd_increase chunks per window of them,
 * up to the pool. */
static void window_update(struct dp_stream *s, int64_t clean, int64_t marked, double now)
{
    if (!s->ce_window)
        return;
    s->ce_results += marked;
    if (marked > 0) {
        if (now >= s->cwnd_hold_until) {
            s->cwnd = fmax(CWND_MIN, s->cwnd / 2.0);
            s->cwnd_hold_until = now + (s->have_srtt ? s->srtt : s->rto_init);
            s->window_cuts++;
        }
        return;
    }
    s->cwnd = fmin((double)s->pool, s->cwnd + (double)clean * s->cwnd_increase / s->cwnd);
}

/* Chunk c + pool goes out only once chunk c is done (_Exchange.sendable/mark_sent). */
static int send_window(struct dp_stream *s, struct scratch *m, double now, double rto)
{
    int64_t lo = s->next_unsent, hi = s->available < lo + s->pool ? s->available : lo + s->pool;
    int64_t k = 0, room = window_room(s);
    for (int64_t c = lo; c < hi && k < room; c++)
        if (!s->sent[c] && (c < s->pool || s->done[c - s->pool]))
            m->chunks[k++] = c;
    int err = send_chunks(s, m, m->chunks, k);
    if (err)
        return err;
    for (int64_t i = 0; i < k; i++) {
        int64_t c = m->chunks[i];
        s->sent[c] = 1;
        s->sent_at[c] = now;
        s->deadline[c] = now + rto;
    }
    while (s->next_unsent < s->available && s->sent[s->next_unsent])
        s->next_unsent++;
    return 0;
}

/* Late chunks with evidence of a loss (_Exchange.expired): only one overtaken by a done
 * chunk sent no earlier; after a stall of an RTO every expired chunk, but before the
 * stream's first result only the oldest, the next stall due with its backed-off timer
 * (not in a grace period). Ascending. */
static int64_t expired(struct dp_stream *s, int64_t *out, double now, double rto)
{
    int64_t lo = done_prefix(s), hi = sent_bound(s), k = 0;
    int stall = now - s->ex_last_progress >= rto;
    double later = -INFINITY;          /* latest sent_at of a done chunk above c */
    for (int64_t c = hi - 1; c >= lo; c--) {
        if (!s->done[c] && s->sent[c] && s->deadline[c] <= now
                && (stall || later >= s->sent_at[c]))
            out[k++] = c;
        if (s->done[c] && s->sent_at[c] > later)
            later = s->sent_at[c];
    }
    if (stall && k && s->n_done == 0 && !s->stall_all) {
        int64_t oldest = out[k - 1];   /* filled from the top down: the oldest is last */
        double backoff = fmin(s->backoff[oldest] * 2.0, MAX_BACKOFF);
        /* the stall clock: the next stall is due with the oldest's new deadline */
        s->ex_last_progress = now + fmin(rto * backoff, s->rto_max) - rto;
        out[0] = oldest;
        return 1;
    }
    for (int64_t i = 0; i < k / 2; i++) {
        int64_t t = out[i];
        out[i] = out[k - 1 - i];
        out[k - 1 - i] = t;
    }
    return k;
}

static int retransmit(struct dp_stream *s, struct scratch *m, double now, double rto)
{
    int64_t k = expired(s, m->chunks, now, rto);
    for (int64_t i = 0; i < k; i++) {
        int64_t c = m->chunks[i];
        s->rows[c * s->row_width + 1] |= FLAG_RETX;     /* header byte 1: flags */
        if (s->ect_retx && (s->tos[c] & 3) == 0)
            s->tos[c] |= 2;          /* ECT(0): a DLCP queue marks it, not drops it again */
    }
    int err = send_chunks(s, m, m->chunks, k);
    if (err)
        return err;
    for (int64_t i = 0; i < k; i++) {
        int64_t c = m->chunks[i];
        s->retransmitted[c] = 1;
        s->sent_at[c] = now;
        s->backoff[c] = fmin(s->backoff[c] * 2.0, MAX_BACKOFF);
        s->deadline[c] = now + fmin(rto * s->backoff[c], s->rto_max);
    }
    s->retransmissions += k;
    return 0;
}

/* ------------------------------------------------------------------ receiving */

/* Apply rx rows [lo, n) as AggregatorTransport._apply does; stop at a STRAGGLER notice
 * (DP_NOTICE, rx_next = its row). *progress: a result was accepted. */
static int apply_rows(struct dp_stream *s, int64_t lo, int64_t n, int *progress)
{
    double oldest_clean = INFINITY;    /* Karn: RTT only from chunks sent once */
    int accepted = 0, status = DP_DONE;
    int64_t clean = 0, marked = 0;     /* accepted RESULTs without / with a CE mark */
    for (int64_t i = lo; i < n; i++) {
        const uint8_t *row = s->rx + i * s->rx_width;
        int64_t len = s->rx_len[i];
        if (len < HEADER_LEN) {
            s->ignored++;
            continue;
        }
        int type = row[0] & 0x0F;
        int64_t slot = be16_at(row + 4), round = be32_at(row + 8);
        uint32_t contributors = be32_at(row + 16);
        int64_t offset = be32_at(row + 24), nv = be16_at(row + 28);
        int64_t chunk = offset / s->vpp;
        int ours = (row[0] >> 4) == VERSION && be16_at(row + 2) == s->job
            && be32_at(row + 20) == (uint32_t)s->tensor && offset % s->vpp == 0
            && chunk < s->n_chunks && slot == chunk % s->pool;
        if (ours && type == TYPE_STRAGGLER && round == s->rounds[chunk]) {
            s->probed[chunk] = contributors;           /* a probe's answer */
            continue;
        }
        if (ours && type == TYPE_STRAGGLER && round > s->rounds[chunk]) {
            s->rx_next = i;
            status = DP_NOTICE;
            break;
        }
        int64_t values = s->num_values - chunk * s->vpp;
        if (values > s->vpp)
            values = s->vpp;
        if (!(ours && type == TYPE_RESULT && round == s->rounds[chunk] && nv == values
              && len >= HEADER_LEN + nv)) {
            s->ignored++;
            continue;
        }
        if (s->done[chunk]) {
            s->duplicates++;
            continue;
        }
        memcpy(s->sums + chunk * s->vpp, row + HEADER_LEN, (size_t)nv);
        s->contributors[chunk] = contributors;
        s->counts[chunk] = row[30];
        s->done[chunk] = 1;
        s->n_done++;
        s->results_accepted++;
        if (s->rx_tos && (s->rx_tos[i] & 3) == ECN_CE)
            marked++;
        else
            clean++;
        if (!s->retransmitted[chunk] && s->sent_at[chunk] < oldest_clean)
            oldest_clean = s->sent_at[chunk];
        accepted = 1;
    }
    if (accepted) {
        double now = monotonic_now();
        s->ex_last_progress = now;
        if (oldest_clean < INFINITY)
            rtt_sample(s, now - oldest_clean);   /* one sample per batch, its latest */
        window_update(s, clean, marked, now);
        *progress = 1;
    }
    return status;
}

/* The ToS byte of a received datagram (IP_RECVTOS), 0 where the kernel gave none. */
static uint8_t tos_of(struct msghdr *h)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c))
        if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS
                && c->cmsg_len >= CMSG_LEN(1))
            return *(const uint8_t *)CMSG_DATA(c);
    return 0;
}

/* Drain the socket (one recvmmsg, without blocking) and apply what came. */
static int receive(struct dp_stream *s, struct scratch *m, int *progress)
{
    s->recv_calls++;
    if (s->rx_tos)                     /* the kernel shrinks it to what it wrote */
        for (int64_t i = 0; i < s->rx_rows; i++)
            m->rx[i].msg_hdr.msg_controllen = sizeof m->rx_control[i].buf;
    int n = recvmmsg((int)s->fd, m->rx, (unsigned)s->rx_rows, MSG_DONTWAIT, NULL);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return DP_DONE;
        s->err = errno;
        return DP_ERRNO;
    }
    if (n == 0)
        return DP_DONE;
    s->heard = 1;
    s->packets_received += n;
    s->rx_count = n;
    for (int i = 0; i < n; i++) {
        s->rx_len[i] = m->rx[i].msg_len;
        s->bytes_received += m->rx[i].msg_len;
        if (m->rx[i].msg_hdr.msg_flags & MSG_TRUNC)
            s->rx_truncated++;
        if (s->rx_tos)
            s->rx_tos[i] = tos_of(&m->rx[i].msg_hdr);
    }
    return apply_rows(s, 0, n, progress);
}

/* ------------------------------------------------------------------ the loop */

/* One round (AggregatorTransport._round): take in results, send, retransmit. */
static int one_round(struct dp_stream *s, struct scratch *m, int *progress_out)
{
    int progress = 0;
    int status = receive(s, m, &progress);
    *progress_out = progress;
    if (progress)
        s->stream_last_progress = monotonic_now();
    if (status != DP_DONE)
        return status;
    double now = monotonic_now();
    int err = send_window(s, m, now, rto_of(s));
    if (!err)
        err = retransmit(s, m, now, rto_of(s));
    if (err) {
        s->err = err;
        return DP_ERRNO;
    }
    return DP_DONE;
}

/* When the next retransmission may be due (_Exchange.next_deadline). */
static double next_deadline(struct dp_stream *s, double now, double rto)
{
    double upcoming = INFINITY;
    int held = 0;
    for (int64_t c = done_prefix(s), hi = sent_bound(s); c < hi; c++) {
        if (s->done[c] || !s->sent[c])
            continue;
        if (s->deadline[c] > now)
            upcoming = fmin(upcoming, s->deadline[c]);
        else
            held = 1;                  /* expired but held back: due at a stall */
    }
    return held ? fmin(upcoming, s->ex_last_progress + rto) : upcoming;
}

/* Interrupt-style moderation: while at least half the window is still in flight, a
 * RESULT taken in now only lets one more chunk out, and the aggregator has work queued
 * for about half a round trip, so the loop sleeps and takes in what gathered with one
 * recvmmsg instead of waking once per RESULT (the aggregator answers slot by slot). The
 * pause is s->moderation, at most a quarter of the smoothed RTT (so the half window
 * still in flight keeps the path busy while the loop sleeps), and none before the first
 * RTT sample. Near the end of a window or a call it waits as before, so the tail latency
 * does not grow. Returns the pause in seconds, 0 for none. */
static double moderation_pause(const struct dp_stream *s, int progress)
{
    if (s->moderation <= 0 || !progress || !s->have_srtt)
        return 0;
    int64_t in_flight = outstanding(s);
    if (2 * in_flight < s->pool || in_flight < 4)
        return 0;
    return fmin(s->moderation, s->srtt / 4);
}

static void pause_for(double seconds)
{
    struct timespec ts = timespec_of(seconds);
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static void free_scratch(struct scratch *m)
{
    free(m->chunks);
    free(m->tx);
    free(m->tx_iov);
    free(m->tx_control);
    free(m->rx);
    free(m->rx_iov);
    free(m->rx_control);
}

static int alloc_scratch(struct dp_stream *s, struct scratch *m)
{
    memset(m, 0, sizeof *m);
    m->chunks = malloc(sizeof *m->chunks * (size_t)(s->n_chunks ? s->n_chunks : 1));
    m->tx = malloc(sizeof *m->tx * SEND_BATCH);
    m->tx_iov = malloc(sizeof *m->tx_iov * SEND_BATCH);
    m->tx_control = calloc(SEND_BATCH, sizeof *m->tx_control);
    m->rx = calloc((size_t)s->rx_rows, sizeof *m->rx);
    m->rx_iov = calloc((size_t)s->rx_rows, sizeof *m->rx_iov);
    m->rx_control = calloc((size_t)s->rx_rows, sizeof *m->rx_control);
    if (!m->chunks || !m->tx || !m->tx_iov || !m->tx_control || !m->rx || !m->rx_iov
            || !m->rx_control) {
        free_scratch(m);
        return ENOMEM;
    }
    for (int64_t i = 0; i < s->rx_rows; i++) {
        m->rx_iov[i].iov_base = s->rx + i * s->rx_width;
        m->rx_iov[i].iov_len = (size_t)s->rx_width;
        m->rx[i].msg_hdr.msg_iov = &m->rx_iov[i];
        m->rx[i].msg_hdr.msg_iovlen = 1;
        if (s->rx_tos) {
            m->rx[i].msg_hdr.msg_control = m->rx_control[i].buf;
            m->rx[i].msg_hdr.msg_controllen = sizeof m->rx_control[i].buf;
        }
    }
    return 0;
}

/* A grace period that starts once grace_at chunks are done (a bounded-loss rule, as
 * host.allreduce's settle states it): the call ends at most grace_rtos RTOs later; the
 * chunks already overdue go out again at once and every pending chunk's timer is
 * re-armed to at most one RTO, as _Exchange.start_grace does. */
static void start_grace(struct dp_stream *s)
{
    if (s->grace_at < 0 || s->n_done < s->grace_at)
        return;
    double now = monotonic_now(), rto = rto_of(s);
    s->until = fmin(s->until, now + s->grace_rtos * rto);
    s->ex_last_progress = fmin(s->ex_last_progress, now - rto);
    for (int64_t c = done_prefix(s), hi = sent_bound(s); c < hi; c++)
        if (!s->done[c] && s->sent[c])
            s->deadline[c] = fmin(s->deadline[c], now + rto);
    s->stall_all = 1;
    s->grace_at = -2;                  /* started: Python takes `until` from here */
}

/* Rounds until chunks [0, target) are done, or at least at_least chunks in any order
 * (a bounded-loss rule's necessary condition, so it needs no Python between arrivals);
 * block=0: one round. A status other than DP_DONE says what Python must do (the module
 * comment). */
int dp_run(struct dp_stream *s, int block, int64_t target, int64_t at_least)
{
    struct scratch m;
    int status, err = alloc_scratch(s, &m);
    if (err) {
        s->err = err;
        return DP_ERRNO;
    }
    for (;;) {
        int progress;
        status = one_round(s, &m, &progress);
        start_grace(s);
        if (status != DP_DONE || !block || done_prefix(s) >= target || s->n_done >= at_least)
            break;
        if (s->available < s->n_chunks && s->done_prefix >= s->available) {
            status = DP_WAITING_INPUT;
            break;
        }
        double now = monotonic_now();
        if (now >= s->until) {
            status = DP_DEADLINE;
            break;
        }
        double wait = fmin(fmin(next_deadline(s, now, rto_of(s)) - now,
                                s->stream_last_progress + s->timeout - now), s->until - now);
        double pause = wait > 0 ? moderation_pause(s, progress) : 0;
        if (pause > 0) {
            pause_for(fmin(pause, wait));
            wait = 0;                  /* then only look at the wake-up pipe */
        }
        int woken = wait_input(s, wait);
        if (woken < 0 && errno != EINTR) {
            s->err = errno;
            status = DP_ERRNO;
            break;
        }
        if (woken > 0) {
            status = DP_WOKEN;
            break;
        }
        if (monotonic_now() - s->stream_last_progress > s->timeout) {
            status = DP_TIMEOUT;
            break;
        }
    }
    free_scratch(&m);
    return status;
}

/* The size of struct dp_stream, so the loader can refuse a mismatched build. */
int64_t dp_stream_size(void) { return (int64_t)sizeof(struct dp_stream); }
