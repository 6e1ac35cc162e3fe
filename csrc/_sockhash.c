/* kvstore._copyhash, third part: a page's bytes received into (or sent from) its buffer over
 * a blocking socket, each chunk hashed right after it lands (before it leaves), the whole
 * page in one call with the GIL released. Why: in Python each 256 KiB chunk took a
 * recv_into, a hash call and a re-armed timeout, each taking the GIL back; the TCP plane's
 * receiving and sending threads then waited on the server's other Python work (and it on
 * them), and the per-chunk Python was a tenth of both sides' CPU (perf).
 *
 * Both bound every blocking call by ``deadline`` (CLOCK_MONOTONIC seconds, as Python's
 * time.monotonic()): before each call the kernel's timeout is set to what is left, so a
 * peer that trickles cannot stretch a page past it. They return a status, never raise for
 * the peer's doing: the caller maps it to its errors. */
#include "_copyhash.h"
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

enum { DONE = 0, CLOSED = 1, LATE = 2, FAILED = 3, MISMATCH = 4 };

#define LONGEST_WAIT_S 1e9  /* ~31 years: an infinite deadline waits this long, within time_t */

/* Sets SO_RCVTIMEO or SO_SNDTIMEO to what is left of deadline; 0 when nothing is left (also
 * for a NaN deadline). An infinite one is held to LONGEST_WAIT_S: a double beyond time_t's
 * range cast to it is undefined behaviour (setsockopt then said EDOM here). */
static int arm(int fd, int option, double deadline) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double left = deadline - ((double)now.tv_sec + now.tv_nsec * 1e-9);
    if (!(left > 0)) return 0;
    if (left > LONGEST_WAIT_S) left = LONGEST_WAIT_S;
    struct timeval tv;
    tv.tv_sec = (time_t)left;
    tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;  /* 0 would mean no timeout at all */
    return setsockopt(fd, SOL_SOCKET, option, &tv, sizeof tv) == 0 ? 1 : -1;
}

/* After EAGAIN: waits (at most what is left of deadline) for the socket to be ready. A socket
 * with a Python timeout is O_NONBLOCK, its kernel timeout unused: without this wait the loop
 * spun on EAGAIN, a core busy until the peer moved. */
static void wait_ready(int fd, short events, double deadline) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double left = deadline - ((double)now.tv_sec + now.tv_nsec * 1e-9);
    if (left <= 0) return;
    struct pollfd p = {.fd = fd, .events = events, .revents = 0};
    poll(&p, 1, left > 3600.0 ? 3600000 : (int)(left * 1000.0) + 1);
}

static int get_args(PyObject *args, const char *fmt, int *fd, Py_buffer *buf, int writable, PyObject **sum,
                    Py_ssize_t *chunk, double *deadline, unsigned long long *expected, void **state) {
    int ok = expected ? PyArg_ParseTuple(args, fmt, fd, buf, sum, chunk, deadline, expected)
                      : PyArg_ParseTuple(args, fmt, fd, buf, sum, chunk, deadline);
    if (!ok) return -1;
    if (*chunk <= 0 || (writable && buf->readonly)) {
        PyErr_SetString(PyExc_ValueError, writable ? "needs a positive chunk and a writable buffer" : "needs a positive chunk");
        PyBuffer_Release(buf);
        return -1;
    }
    if ((*state = checksum_take(*sum)) == NULL) {
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

const char recv_hashed_doc[] =
    "recv_hashed(fd, buffer, checksum, chunk, deadline) -> (received, status, errno)\n\n"
    "Fills the contiguous writable buffer from the socket, feeding checksum each piece as it lands.\n"
    "status: 0 filled, 1 the peer closed (or the socket was shut), 2 the deadline passed, 3 errno.";

PyObject *recv_hashed(PyObject *self, PyObject *args) {
    int fd, status = DONE, err = 0;
    Py_buffer buf;
    PyObject *sum;
    Py_ssize_t chunk, got = 0;
    double deadline;
    void *state;
    if (get_args(args, "iw*Ond", &fd, &buf, 1, &sum, &chunk, &deadline, NULL, &state) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    char *p = (char *)buf.buf;
    while (got < buf.len) {
        int armed = arm(fd, SO_RCVTIMEO, deadline);
        if (armed <= 0) {
            status = armed == 0 ? LATE : FAILED;
            err = armed == 0 ? 0 : errno;
            break;
        }
        Py_ssize_t want = buf.len - got < chunk ? buf.len - got : chunk;
        ssize_t n = recv(fd, p + got, (size_t)want, MSG_WAITALL);
        if (n > 0) {
            xxh3_update(state, p + got, (size_t)n);
            got += n;
        } else if (n == 0) {
            status = CLOSED;
            break;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            wait_ready(fd, POLLIN, deadline);  /* the kernel's timeout expired, or O_NONBLOCK: arm decides */
        } else if (errno == EINTR) {
            continue;
        } else {
            status = FAILED;
            err = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    checksum_give(sum);
    PyBuffer_Release(&buf);
    return Py_BuildValue("nii", got, status, err);
}

const char send_hashed_doc[] =
    "send_hashed(fd, buffer, checksum, chunk, deadline, expected) -> (sent, status, errno)\n\n"
    "Sends the contiguous buffer (a fresh checksum: all of it is fed), each chunk hashed just before\n"
    "it is sent; the last chunk only if the whole buffer hashed to expected. status: 0 sent,\n"
    "2 the deadline passed, 3 errno (EPIPE, ECONNRESET: the peer went away), 4 mismatch (the rest unsent).";

PyObject *send_hashed(PyObject *self, PyObject *args) {
    int fd, status = DONE, err = 0;
    Py_buffer buf;
    PyObject *sum;
    Py_ssize_t chunk, sent = 0;
    double deadline;
    unsigned long long expected;
    void *state;
    if (get_args(args, "iy*OndK", &fd, &buf, 0, &sum, &chunk, &deadline, &expected, &state) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const char *p = (const char *)buf.buf;
    if (buf.len == 0 && xxh3_digest(state) != expected) status = MISMATCH;  /* no chunk, still a page to check */
    for (Py_ssize_t at = 0; at < buf.len && status == DONE; at += chunk) {
        Py_ssize_t end = buf.len - at < chunk ? buf.len : at + chunk;
        xxh3_update(state, p + at, (size_t)(end - at));
        if (end == buf.len && xxh3_digest(state) != expected) {
            status = MISMATCH;
            break;
        }
        while (sent < end) {
            int armed = arm(fd, SO_SNDTIMEO, deadline);
            if (armed <= 0) {
                status = armed == 0 ? LATE : FAILED;
                err = armed == 0 ? 0 : errno;
                break;
            }
            ssize_t n = send(fd, p + sent, (size_t)(end - sent), MSG_NOSIGNAL);
            if (n >= 0) {
                sent += n;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
                wait_ready(fd, POLLOUT, deadline);
            } else if (errno != EINTR) {
                status = FAILED;
                err = errno;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    checksum_give(sum);
    PyBuffer_Release(&buf);
    return Py_BuildValue("nii", sent, status, err);
}
