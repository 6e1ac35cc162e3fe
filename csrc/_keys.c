/* Chained page keys in one native call (kvstore/keys.py): key[i] = BLAKE2b-128(key[i-1] || page i),
 * personalised, bit-identical to hashlib.blake2b(prev + page, digest_size=16, person=...).
 *
 * Why here: hashlib costs ~1 us a page in Python calls and object churn, a 512-page prefix ~0.5 ms
 * per lookup; this is one call, the GIL released while it hashes. BLAKE2b as in RFC 7693 (no key,
 * no salt, sequential mode: fanout 1, depth 1). tests/test_keys.py pins digests and compares with
 * hashlib over random inputs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 128
#define DIGEST 16

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];            \
        v[b] = rotr(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];            \
        v[b] = rotr(v[b] ^ v[c], 63);  \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[BLOCK], uint64_t counter, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= counter;  /* the high word of the 128-bit counter stays 0: no message here reaches 2**64 bytes */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of ``a || b`` from the initial state ``h0`` (the parameter block folded in). */
static void hash_two(const uint64_t h0[8], const uint8_t *a, size_t na, const uint8_t *b, size_t nb, uint8_t out[DIGEST]) {
    uint64_t h[8];
    uint8_t block[BLOCK];
    size_t fill = 0, total = na + nb, done = 0;
    memcpy(h, h0, sizeof h);
    for (int part = 0; part < 2; part++) {
        const uint8_t *p = part ? b : a;
        size_t n = part ? nb : na;
        while (n > 0) {
            if (fill == BLOCK) {  /* a full block with more to come: not the last */
                done += BLOCK;
                compress(h, block, done, 0);
                fill = 0;
            }
            size_t take = BLOCK - fill < n ? BLOCK - fill : n;
            memcpy(block + fill, p, take);
            fill += take;
            p += take;
            n -= take;
        }
    }
    memset(block + fill, 0, BLOCK - fill);
    compress(h, block, (uint64_t)total, 1);
    for (int i = 0; i < DIGEST; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

PyDoc_STRVAR(chain_keys_doc,
             "chain_keys(first, data, page_bytes, person) -> list[bytes]\n\n"
             "key[i] = BLAKE2b(key[i-1] || data[i*page_bytes:(i+1)*page_bytes], digest_size=16, person=person),\n"
             "key[-1] = first, for every whole page of ``data``.");

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    Py_buffer first, data, person;
    Py_ssize_t page_bytes;
    if (!PyArg_ParseTuple(args, "y*y*ny*", &first, &data, &page_bytes, &person)) return NULL;
    PyObject *result = NULL;
    uint8_t *digests = NULL;
    if (page_bytes <= 0 || person.len > 16) {
        PyErr_SetString(PyExc_ValueError, "page_bytes must be > 0 and person at most 16 bytes");
        goto done;
    }
    Py_ssize_t n = data.len / page_bytes;
    digests = malloc(n > 0 ? (size_t)n * DIGEST : 1);
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t params[64] = {DIGEST, 0, 1, 1};  /* digest length, key length, fanout, depth; the rest 0 */
    memcpy(params + 48, person.buf, (size_t)person.len);
    uint64_t h0[8];
    for (int i = 0; i < 8; i++) h0[i] = IV[i] ^ load64(params + 8 * i);
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *pages = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *prev = i ? digests + (i - 1) * DIGEST : first.buf;
        hash_two(h0, prev, i ? DIGEST : (size_t)first.len, pages + i * page_bytes, (size_t)page_bytes, digests + i * DIGEST);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST, DIGEST);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }
done:
    free(digests);
    PyBuffer_Release(&first);
    PyBuffer_Release(&data);
    PyBuffer_Release(&person);
    return result;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS, chain_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keys(void) { return PyModule_Create(&module); }
