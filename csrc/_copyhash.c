/* kvstore._copyhash: copy page bytes and compute their xxh3-64 checksum in one pass.
 *
 * Why native: a page copy followed by a separate checksum pass reads every byte twice and
 * its stores pull each destination line into the cache first (read-for-ownership), so on
 * a 2-core host copy+hash in numpy reaches ~0.65x of memcpy. Here each piece of a row is
 * hashed while it sits in L1 and written with non-temporal stores, which is ~1.4x faster.
 *
 * The hash is the xxh3-64 of the python `xxhash` package itself (its extension exports the
 * XXH3 streaming functions; they are found with dlsym), so the digest is by construction
 * the one `kvstore.page.checksum` computes. When anything is missing the import fails and
 * kvstore.fastcopy falls back to numpy; the result is the same, only slower.
 */
#include "_copyhash.h"
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

create_fn xxh3_create;
free_fn xxh3_free;
reset_fn xxh3_reset;
update_fn xxh3_update;
digest_fn xxh3_digest;

/* Copies n bytes from src to dst with streamed (non-temporal) stores. With keep (n bytes, meant
 * to stay in L1) each byte of src is loaded once and stored to both, so keep holds exactly what
 * dst received even when another process writes src meanwhile. Inlined into the two entry
 * points below with keep constant, so the plain copy carries no test of it. */
static inline __attribute__((always_inline)) void streamed_copy(char *dst, char *keep, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    size_t i = head;
    if (keep) {
        memcpy(keep, src, head);
        __asm__ volatile("" ::: "memory");  /* keep the two copies: folded into dst <- src, src would be read twice */
        memcpy(dst, keep, head);
    } else {
        memcpy(dst, src, head);
    }
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        if (keep) {
            _mm_storeu_si128((__m128i *)(keep + i), a);
            _mm_storeu_si128((__m128i *)(keep + i + 16), b);
            _mm_storeu_si128((__m128i *)(keep + i + 32), c);
            _mm_storeu_si128((__m128i *)(keep + i + 48), d);
        }
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    src += i, dst += i, n -= i;
    if (keep) keep += i;
#endif
    if (keep) {
        memcpy(keep, src, n);
        __asm__ volatile("" ::: "memory");
        memcpy(dst, keep, n);
    } else {
        memcpy(dst, src, n);
    }
}

void stream_copy(char *dst, const char *src, size_t n) { streamed_copy(dst, NULL, src, n); }

void stream_copy_keep(char *dst, char *keep, const char *src, size_t n) { streamed_copy(dst, keep, src, n); }

/* A 2-D uint8 buffer whose rows are contiguous (any row stride). */
static int rows_view(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->ndim != 2 || view->itemsize != 1 || view->strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a 2-D byte array with contiguous rows", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Hashes the rows of src into state and copies them to dst (row r at dst + r * dst_stride),
 * piece by piece while each piece is in L1: streamed (non-temporal) stores for a destination
 * nobody reads soon, plain ones for a message the socket layer reads next. src may be shared
 * memory another process writes (an arena slot): each piece is read from it once, into dst and
 * an L1 buffer (streamed) or into dst (plain), and the hash is taken of that copy, so what is
 * hashed is exactly what lands; hashing src and copying it again would let a writer that
 * flips bytes between the two reads land bytes that were never hashed. No GIL needed. */
static void hash_copy_rows(void *state, const Py_buffer *src, char *dst, Py_ssize_t dst_stride, int stream) {
    char piece[PIECE_BYTES] __attribute__((aligned(64)));
    xxh3_reset(state);
    for (Py_ssize_t r = 0; r < src->shape[0]; r++) {
        const char *s = (const char *)src->buf + r * src->strides[0];
        char *d = dst + r * dst_stride;
        for (Py_ssize_t at = 0; at < src->shape[1]; at += PIECE_BYTES) {
            size_t n = (size_t)(src->shape[1] - at < PIECE_BYTES ? src->shape[1] - at : PIECE_BYTES);
            if (stream) {
                stream_copy_keep(d + at, piece, s + at, n);
                xxh3_update(state, piece, n);
            } else {
                memcpy(d + at, s + at, n);
                xxh3_update(state, d + at, n);
            }
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();  /* the streamed stores are visible before anyone is told the copy is done */
#endif
}

PyDoc_STRVAR(copy_checksum_doc,
"copy_checksum(dst, src) -> int\n\n"
"Copies src into dst (2-D uint8 arrays of one shape, rows contiguous) and returns the\n"
"xxh3-64 of the bytes row after row. Releases the GIL while it copies.");

static PyObject *copy_checksum(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return NULL;
    Py_buffer dst, src;
    if (rows_view(dst_obj, &dst, 1, "dst") < 0) return NULL;
    if (rows_view(src_obj, &src, 0, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.shape[0] != src.shape[0] || dst.shape[1] != src.shape[1]) {
        PyErr_Format(PyExc_ValueError, "dst is %zdx%zd bytes but src is %zdx%zd", dst.shape[0], dst.shape[1],
                     src.shape[0], src.shape[1]);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    void *state = xxh3_create();
    if (state == NULL) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }
    unsigned long long digest;
    Py_BEGIN_ALLOW_THREADS
    hash_copy_rows(state, &src, (char *)dst.buf, dst.strides[0], 1);
    digest = xxh3_digest(state);
    xxh3_free(state);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(frame_checksummed_doc,
"frame_checksummed(head, src, tag) -> (bytes, int)\n\n"
"One message built in one pass: head, then the rows of src (a 2-D uint8 array, rows\n"
"contiguous), then the byte tag and the xxh3-64 of the rows as a 10-byte varint (a\n"
"protobuf parser reads a varint padded to 10 bytes as its value, so the size of the\n"
"message is known before its checksum). Returns the message and the checksum. The rows\n"
"are hashed while they are copied, with ordinary stores: the next reader (the socket\n"
"layer) finds them in cache. Releases the GIL while it copies.");

static PyObject *frame_checksummed(PyObject *self, PyObject *args) {
    Py_buffer head;
    PyObject *src_obj;
    unsigned char tag;
    if (!PyArg_ParseTuple(args, "y*Ob", &head, &src_obj, &tag)) return NULL;
    Py_buffer src;
    if (rows_view(src_obj, &src, 0, "src") < 0) {
        PyBuffer_Release(&head);
        return NULL;
    }
    Py_ssize_t payload = src.shape[0] * src.shape[1];
    PyObject *out = PyBytes_FromStringAndSize(NULL, head.len + payload + 11);
    void *state = out ? xxh3_create() : NULL;
    if (state == NULL) {
        if (out != NULL) {
            Py_DECREF(out);
            PyErr_NoMemory();
        }
        PyBuffer_Release(&head);
        PyBuffer_Release(&src);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    unsigned long long digest;
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, head.buf, (size_t)head.len);
    char *d = dst + head.len;
    hash_copy_rows(state, &src, d, src.shape[1], 0);
    d += payload;
    digest = xxh3_digest(state);
    xxh3_free(state);
    *d++ = (char)tag;
    unsigned long long v = digest;
    for (int i = 0; i < 9; i++, v >>= 7) *d++ = (char)((v & 0x7F) | 0x80);
    *d = (char)v;  /* the 10th byte: the top bit of the 64, no continuation */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&head);
    PyBuffer_Release(&src);
    return Py_BuildValue("(NK)", out, digest);
}

PyDoc_STRVAR(copy_streamed_doc,
"copy_streamed(dst, src) -> None\n\n"
"Copies src into dst (contiguous buffers of one length) with the non-temporal stores\n"
"copy_checksum writes a slot with, and no hash: the memcpy a streamed path is measured\n"
"against. Releases the GIL while it copies.");

static PyObject *copy_streamed(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes but src is %zd", dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
#if defined(__SSE2__)
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_checksum", copy_checksum, METH_VARARGS, copy_checksum_doc},
    {"copy_streamed", copy_streamed, METH_VARARGS, copy_streamed_doc},
    {"frame_checksummed", frame_checksummed, METH_VARARGS, frame_checksummed_doc},
    {"scatter_checksum", scatter_checksum, METH_VARARGS, scatter_checksum_doc},
    {"recv_hashed", recv_hashed, METH_VARARGS, recv_hashed_doc},
    {"send_hashed", send_hashed, METH_VARARGS, send_hashed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._copyhash", NULL, -1, methods};

/* Finds the XXH3 streaming functions in the loaded xxhash extension. */
static int bind_xxh3(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL) return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL) return -1;
    const char *path = PyUnicode_AsUTF8(file);
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    Py_DECREF(file);
    if (lib == NULL) {
        PyErr_SetString(PyExc_ImportError, "cannot dlopen the xxhash extension");
        return -1;
    }
    xxh3_create = (create_fn)dlsym(lib, "XXH3_createState");
    xxh3_free = (free_fn)dlsym(lib, "XXH3_freeState");
    xxh3_reset = (reset_fn)dlsym(lib, "XXH3_64bits_reset");
    xxh3_update = (update_fn)dlsym(lib, "XXH3_64bits_update");
    xxh3_digest = (digest_fn)dlsym(lib, "XXH3_64bits_digest");
    if (!xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_update || !xxh3_digest) {
        PyErr_SetString(PyExc_ImportError, "the xxhash extension does not export the XXH3 streaming functions");
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__copyhash(void) {
    if (bind_xxh3() < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && add_checksum_type(mod) < 0) Py_CLEAR(mod);
    return mod;
}
