/* Shared by the two halves of kvstore._copyhash: _copyhash.c (the module, the page copies)
 * and _scatter.c (Checksum, scatter_checksum). */
#ifndef KVSTORE_COPYHASH_H
#define KVSTORE_COPYHASH_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef unsigned long long (*digest_fn)(const void *);

/* The XXH3 streaming functions of the xxhash extension, bound at import (_copyhash.c). */
extern create_fn xxh3_create;
extern free_fn xxh3_free;
extern reset_fn xxh3_reset;
extern update_fn xxh3_update;
extern digest_fn xxh3_digest;

#define PIECE_BYTES 16384  /* hashed, then stored, while it is in L1 */

/* _copyhash.c: copies n bytes with non-temporal stores (the caller fences) */
void stream_copy(char *dst, const char *src, size_t n);
void stream_copy_keep(char *dst, char *keep, const char *src, size_t n);

/* _scatter.c */
extern const char scatter_checksum_doc[];
PyObject *scatter_checksum(PyObject *self, PyObject *args);
int add_checksum_type(PyObject *module);
void *checksum_take(PyObject *obj);  /* a Checksum's xxh3 state, claimed for a feed outside the GIL (NULL: raised) */
void checksum_give(PyObject *obj);   /* ends that claim (under the GIL) */

/* _sockhash.c */
extern const char recv_hashed_doc[];
extern const char send_hashed_doc[];
PyObject *recv_hashed(PyObject *self, PyObject *args);
PyObject *send_hashed(PyObject *self, PyObject *args);

#endif
