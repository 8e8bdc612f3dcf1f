/* router._native: kvroute's compiled helpers, each the C twin of a pure-Python path
 * that gives the same answer (tests hold them equal) and runs where this is not built.
 *
 * 1. The block-key chain of router/hashing.py in one C call:
 *
 *     key[-1] = seed
 *     key[i]  = XXH3_64bits_withSeed(le_u32(tokens of block i), seed = key[i-1])
 *
 * block_keys(tokens, block_size, seed, max_blocks) -> list[int]
 *
 * ``tokens``: a list or tuple of ints, or a buffer of native uint32 (array('I')), or
 * bytes of little-endian uint32. Every id is checked as router.hashing.tokens_to_bytes
 * checks it (OverflowError outside [0, 2**32), TypeError without __index__), the trailing
 * partial block included; only full blocks are hashed, at most ``max_blocks`` of them
 * (negative: no limit). The keys are the pure-Python path's, bit for bit (a test holds
 * them equal).
 *
 * 2. The emulator's word tokenizer (router/tokenization/words.py) for ASCII text:
 *
 * word_ids(text, markers, first, span) -> list[int] | None
 * word_ids_packed(text, markers, first, span) -> bytes | None
 *
 * One id per word of ``text.split()``: ``markers[word]`` for a chat marker, else
 * ``first + XXH32(word, 0) % span``. None when ``text`` is not ASCII (the caller encodes
 * it in Python, where UTF-8 with surrogates and Unicode whitespace are str's own).
 * word_ids_packed gives the same ids as the bytes of native uint32s (for array('I')),
 * without making an int object per word.
 *
 * 3. The compact in-memory index and the event streams' engine-hash maps: BlockIndex and
 * BlockMap, in blocktable.c (which says what they are).
 *
 * 4. The kv_cost policy's cost terms over every candidate: kv_cost_scan, in cost.c.
 * 5. The latency policy's cost terms over every candidate: latency_scan, in latency.c.
 *
 * xxhash.h is xxHash 0.8.4 (BSD 2-Clause, LICENSE.xxhash), the version python-xxhash
 * 4.1.0 bundles; it is compiled in here, inlined.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define STACK_TOKENS 2048

static int
little_endian(void)
{
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

/* out[i] = src[i] with its bytes reversed (native big-endian -> the keys' little-endian) */
static void
swap_u32(uint32_t *out, const uint32_t *src, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t v = src[i];
        out[i] = (v >> 24) | ((v >> 8) & 0xFF00u) | ((v << 8) & 0xFF0000u) | (v << 24);
    }
}

/* ids of a list or tuple, checked and stored as native uint32; -1 with an exception set */
static int
fill_from_sequence(PyObject *seq, uint32_t *out, Py_ssize_t n)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        unsigned long value;
        if (PyLong_Check(item)) {
            value = PyLong_AsUnsignedLong(item);
        } else {
            /* as array('I') takes it: anything with __index__ */
            PyObject *index = PyNumber_Index(item);
            if (index == NULL) {
                return -1;
            }
            value = PyLong_AsUnsignedLong(index);
            Py_DECREF(index);
        }
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_SetString(PyExc_OverflowError, "token id out of range for uint32");
            return -1;
        }
        if (value > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id out of range for uint32");
            return -1;
        }
        out[i] = (uint32_t)value;
    }
    return 0;
}

static PyObject *
hash_chain(const uint8_t *data, Py_ssize_t nblocks, Py_ssize_t step, uint64_t seed)
{
    PyObject *keys = PyList_New(nblocks);
    if (keys == NULL) {
        return NULL;
    }
    uint64_t key = seed;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        key = XXH3_64bits_withSeed(data + i * step, (size_t)step, key);
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, value);
    }
    return keys;
}

static PyObject *
block_keys(PyObject *module, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t block_size, max_blocks;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKn:block_keys", &tokens, &block_size, &seed, &max_blocks)) {
        return NULL;
    }
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    const Py_ssize_t step = block_size * 4;

    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        uint32_t stack[STACK_TOKENS];
        uint32_t *buf = n <= STACK_TOKENS ? stack : PyMem_Malloc((size_t)n * sizeof(uint32_t));
        if (buf == NULL) {
            return PyErr_NoMemory();
        }
        PyObject *keys = NULL;
        if (fill_from_sequence(tokens, buf, n) == 0) {
            if (!little_endian()) {
                swap_u32(buf, buf, n);
            }
            Py_ssize_t nblocks = n / block_size;
            if (max_blocks >= 0 && nblocks > max_blocks) {
                nblocks = max_blocks;
            }
            keys = hash_chain((const uint8_t *)buf, nblocks, step, (uint64_t)seed);
        }
        if (buf != stack) {
            PyMem_Free(buf);
        }
        return keys;
    }

    /* bytes (little-endian uint32) or a uint32 buffer such as array('I') */
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    const int is_bytes = PyBytes_Check(tokens);
    const int is_u32 = view.itemsize == 4 && view.format != NULL &&
                       (strcmp(view.format, "I") == 0 || strcmp(view.format, "=I") == 0 ||
                        strcmp(view.format, "<I") == 0 || strcmp(view.format, "L") == 0);
    if (!is_bytes && !is_u32) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_TypeError, "tokens must be a list, bytes or array('I'), not %.100s",
                            Py_TYPE(tokens)->tp_name);
    }
    Py_ssize_t nblocks = view.len / step;
    if (max_blocks >= 0 && nblocks > max_blocks) {
        nblocks = max_blocks;
    }
    PyObject *keys;
    if (is_bytes || little_endian()) {
        keys = hash_chain((const uint8_t *)view.buf, nblocks, step, (uint64_t)seed);
    } else {
        /* a native big-endian array: hash the little-endian encoding of its blocks */
        Py_ssize_t count = nblocks * block_size;
        uint32_t *swapped = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint32_t));
        if (swapped == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        swap_u32(swapped, view.buf, count);
        keys = hash_chain((const uint8_t *)swapped, nblocks, step, (uint64_t)seed);
        PyMem_Free(swapped);
    }
    PyBuffer_Release(&view);
    return keys;
}

#define IS_SPACE(c) Py_UNICODE_ISSPACE((Py_UCS4)(unsigned char)(c))

/* The next word of data[*pos..n) as str.split() cuts it (its ASCII whitespace includes
 * \x1c-\x1f): its start in *start, *pos past it; its length, 0 when none is left. */
static inline Py_ssize_t
next_word(const char *data, Py_ssize_t n, Py_ssize_t *pos, Py_ssize_t *start)
{
    Py_ssize_t i = *pos;
    while (i < n && IS_SPACE(data[i])) {
        i++;
    }
    *start = i;
    while (i < n && !IS_SPACE(data[i])) {
        i++;
    }
    *pos = i;
    return i - *start;
}

/* The id of the word data[start..start+len): a chat marker's from ``markers``, else the
 * hashed id. -1 with an exception set. */
static inline int64_t
word_id(const char *data, Py_ssize_t start, Py_ssize_t len, PyObject *markers,
        unsigned long first, unsigned long span)
{
    if (len >= 4 && data[start] == '<' && data[start + 1] == '|') {
        PyObject *word = PyUnicode_FromStringAndSize(data + start, len);
        if (word == NULL) {
            return -1;
        }
        PyObject *value = PyDict_GetItemWithError(markers, word);
        Py_DECREF(word);
        if (value != NULL) {
            unsigned long id = PyLong_AsUnsignedLong(value);
            if (id == (unsigned long)-1 && PyErr_Occurred()) {
                return -1;
            }
            if (id > 0xFFFFFFFFUL) {
                PyErr_SetString(PyExc_OverflowError, "marker id out of range for uint32");
                return -1;
            }
            return (int64_t)id;
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    return (int64_t)(first + XXH32(data + start, (size_t)len, 0) % span);
}

/* word_ids and word_ids_packed: the ids as a list of ints, or (packed) as the bytes of
 * native uint32s, which array('I').frombytes takes without making an int per word. */
static PyObject *
word_ids_impl(PyObject *args, const char *format, int packed)
{
    PyObject *text, *markers;
    unsigned long first, span;
    if (!PyArg_ParseTuple(args, format, &text, &PyDict_Type, &markers, &first, &span)) {
        return NULL;
    }
    if (span == 0) {
        PyErr_SetString(PyExc_ValueError, "span must be positive");
        return NULL;
    }
    if (first + span - 1 > 0xFFFFFFFFUL || first + span < first) {
        PyErr_SetString(PyExc_OverflowError, "first + span - 1 out of range for uint32");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) {
        Py_RETURN_NONE;
    }
    const char *data = (const char *)PyUnicode_DATA(text);
    const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    /* count the words first, so the result is made at its size */
    Py_ssize_t count = 0, start, len;
    for (Py_ssize_t i = 0; (len = next_word(data, n, &i, &start)) > 0;) {
        count++;
    }
    PyObject *out = packed ? PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t))
                           : PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    uint32_t *buf = packed ? (uint32_t *)PyBytes_AS_STRING(out) : NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; (len = next_word(data, n, &i, &start)) > 0; k++) {
        const int64_t id = word_id(data, start, len, markers, first, span);
        if (id < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (packed) {
            buf[k] = (uint32_t)id;
            continue;
        }
        PyObject *value = PyLong_FromLongLong(id);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, value);
    }
    return out;
}

static PyObject *
word_ids(PyObject *module, PyObject *args)
{
    return word_ids_impl(args, "UO!kk:word_ids", 0);
}

static PyObject *
word_ids_packed(PyObject *module, PyObject *args)
{
    return word_ids_impl(args, "UO!kk:word_ids_packed", 1);
}

static PyMethodDef methods[] = {
    {"block_keys", block_keys, METH_VARARGS,
     "block_keys(tokens, block_size, seed, max_blocks) -> chained XXH3 keys of the full blocks"},
    {"word_ids", word_ids, METH_VARARGS,
     "word_ids(text, markers, first, span) -> the word tokenizer's ids of ASCII text, or None"},
    {"word_ids_packed", word_ids_packed, METH_VARARGS,
     "word_ids_packed(text, markers, first, span) -> word_ids' ids as native uint32 bytes, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._native",
    "kvroute's compiled helpers: block keys, word ids, the compact index, the cost policies' scans (router/native/).", -1, methods,
};

int kvroute_add_block_types(PyObject *module);    /* blocktable.c */
int kvroute_add_cost_functions(PyObject *module); /* cost.c */
int kvroute_add_latency_functions(PyObject *module); /* latency.c */

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "XXH_VERSION", XXH_versionNumber()) != 0 ||
        kvroute_add_block_types(m) != 0 || kvroute_add_cost_functions(m) != 0 ||
        kvroute_add_latency_functions(m) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
