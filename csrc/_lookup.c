/* A lookup's per-key loops in native code (kvstore/directory/store.py, kvstore/validate.py).
 *
 * Why here: a 512-key Lookup spent ~110 us of the server's ~370 us in two Python loops, the
 * directory's prefix walk and the key-length check, with the GIL held (the 8-client lookup
 * rate is CPU-bound on 2 cores). Both loops do exactly what their Python fallbacks do;
 * tests/directory/test_native_walk.py runs the same cases through both.
 *
 * walk(entries, keys, namespace_id, start, runs, entry_type, ns_member, where_member)
 *   Walks keys[start:] while each key's Entry (entries: dict key -> Entry) is of namespace_id
 *   and has its best location cached (Entry.where, a (node, tier, size) tuple), counting pages
 *   into runs: a list of [where, count] lists, the last one extended while where is equal.
 *   Returns (i, stopped): stopped at keys[i] (missing, another namespace's, or i == len(keys)),
 *   or not stopped: keys[i]'s Entry has no cached location; the caller computes it and calls
 *   again from i. ns_member and where_member are Entry's __slots__ descriptors: an entry of
 *   exactly entry_type is read at their offsets, anything else through getattr.
 *
 * first_bad_length(keys, length) -> the index of the first key not `length` long, or -1. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static Py_ssize_t member_offset(PyObject *descr, PyTypeObject *type) {
    if (!PyObject_TypeCheck(descr, &PyMemberDescr_Type)) return -1;
    PyMemberDescrObject *member = (PyMemberDescrObject *)descr;
    if (member->d_common.d_type != type || member->d_member->type != T_OBJECT_EX) return -1;
    return member->d_member->offset;
}

/* A new reference to the attribute, or NULL with an exception set. */
static PyObject *read_member(PyObject *obj, PyTypeObject *type, Py_ssize_t offset, PyObject *name) {
    if (Py_TYPE(obj) == type && offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + offset);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(obj, name);
}

static int store_count(PyObject *runs, Py_ssize_t count) {
    Py_ssize_t n = PyList_GET_SIZE(runs);
    if (n == 0) return 0;
    PyObject *value = PyLong_FromSsize_t(count);
    if (value == NULL) return -1;
    return PyList_SetItem(PyList_GET_ITEM(runs, n - 1), 1, value);  /* steals value */
}

static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *entries, *keys, *ns, *runs, *ns_descr, *where_descr;
    PyTypeObject *entry_type;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!OnO!O!OO", &PyDict_Type, &entries, &PyList_Type, &keys, &ns, &start,
                          &PyList_Type, &runs, &PyType_Type, &entry_type, &ns_descr, &where_descr))
        return NULL;
    static PyObject *ns_name, *where_name;
    if (ns_name == NULL && (ns_name = PyUnicode_InternFromString("namespace_id")) == NULL) return NULL;
    if (where_name == NULL && (where_name = PyUnicode_InternFromString("where")) == NULL) return NULL;
    Py_ssize_t ns_off = member_offset(ns_descr, entry_type), where_off = member_offset(where_descr, entry_type);

    PyObject *current = NULL;  /* the last run's where (borrowed from runs) */
    Py_ssize_t count = 0, n_runs = PyList_GET_SIZE(runs);
    if (n_runs > 0) {
        PyObject *last = PyList_GET_ITEM(runs, n_runs - 1);
        if (!PyList_Check(last) || PyList_GET_SIZE(last) != 2) {
            PyErr_SetString(PyExc_TypeError, "runs must hold [where, count] lists");
            return NULL;
        }
        current = PyList_GET_ITEM(last, 0);
        count = PyLong_AsSsize_t(PyList_GET_ITEM(last, 1));
        if (count < 0 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t i = start < 0 ? 0 : start;
    int stopped = 1;
    for (; i < PyList_GET_SIZE(keys); i++) {
        PyObject *entry = PyDict_GetItemWithError(entries, PyList_GET_ITEM(keys, i));  /* borrowed */
        if (entry == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        Py_INCREF(entry);  /* the dict is only read here, but a comparison below may run Python code */
        PyObject *entry_ns = read_member(entry, entry_type, ns_off, ns_name);
        if (entry_ns == NULL) {
            Py_DECREF(entry);
            goto fail;
        }
        int same = entry_ns == ns ? 1 : PyObject_RichCompareBool(entry_ns, ns, Py_EQ);
        Py_DECREF(entry_ns);
        if (same <= 0) {
            Py_DECREF(entry);
            if (same < 0) goto fail;
            break;
        }
        PyObject *where = read_member(entry, entry_type, where_off, where_name);
        Py_DECREF(entry);
        if (where == NULL) goto fail;
        if (where == Py_None) {
            Py_DECREF(where);
            stopped = 0;
            break;
        }
        int equal = current == NULL ? 0 : (where == current ? 1 : PyObject_RichCompareBool(where, current, Py_EQ));
        if (equal < 0) {
            Py_DECREF(where);
            goto fail;
        }
        if (!equal) {
            if (store_count(runs, count) < 0) {
                Py_DECREF(where);
                goto fail;
            }
            PyObject *run = Py_BuildValue("[On]", where, (Py_ssize_t)0);
            if (run == NULL || PyList_Append(runs, run) < 0) {
                Py_XDECREF(run);
                Py_DECREF(where);
                goto fail;
            }
            Py_DECREF(run);
            current = where;  /* now held by runs */
            count = 0;
        }
        Py_DECREF(where);
        count++;
    }
    if (store_count(runs, count) < 0) return NULL;
    return Py_BuildValue("(nO)", i, stopped ? Py_True : Py_False);
fail:
    return NULL;  /* runs' last count is stale: the caller raises */
}

static PyObject *first_bad_length(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &keys, &length)) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t size = PyBytes_Check(key) ? PyBytes_GET_SIZE(key) : PyObject_Length(key);
        if (size < 0 && PyErr_Occurred()) return NULL;
        if (size != length) return PyLong_FromSsize_t(i);
    }
    return PyLong_FromLong(-1);
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "The directory's prefix walk (see the module comment)."},
    {"first_bad_length", first_bad_length, METH_VARARGS, "The first key not of the given length, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._lookup", NULL, -1, methods};

PyMODINIT_FUNC PyInit__lookup(void) { return PyModule_Create(&module); }
