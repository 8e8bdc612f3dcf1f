/* router._native.BlockIndex and router._native.BlockMap: the compact in-memory KV-block
 * index (issue 24), the C twin of router/index/memory.py's bitmask tables and of the dict
 * an event stream keeps from engine hashes to block keys. Tests hold them equal to the
 * pure-Python paths, which run where this is not built.
 *
 * BlockIndex keeps three structures, every number in them a plain machine word:
 *
 * - the key table: block key -> holder set id, open addressing with linear probing
 *   (12 bytes a slot, at most 85% full, grown by a third: block keys are XXH3 outputs,
 *   uniformly spread, so probe runs stay short);
 * - holder sets, interned: a sorted array of elements ``engine id << 2 | code`` (code 0
 *   GPU, 1 CPU, 2 disk, 3 an expiring GPU record), shared by every key with the same
 *   holders, so a block held by one engine costs no set of its own and a block held by
 *   32 costs 4 bytes an engine; a small cache remembers recent set edits, which along a
 *   chain of blocks are the same edit again;
 * - per engine and tier, the keys it holds firmly in the order stored (an ordered set:
 *   the keys in an array with holes, an index of 4-byte slots into it), which is what
 *   clearing an engine and evicting the least recently stored need.
 *
 * Expiring records (a routing decision's provisional holders) are holder elements too,
 * with their deadlines in a table of (key, engine) -> deadline and a heap to sweep by.
 *
 * A lookup walks the prompt's keys; a run of keys with the same holder set (the usual
 * case along a chain) costs one probe a key, and only a change of set touches engines.
 *
 * BlockMap is an insertion-ordered map of unsigned 64-bit ints to unsigned 64-bit ints
 * (the same ordered table with values), with the dict methods an event stream uses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define CODE_GPU 0u
#define CODE_CPU 1u
#define CODE_DISK 2u
#define CODE_EXPIRING 3u
#define TIERS 3
#define MEMO_SIZE 4096u

static inline uint64_t
mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* the home slot of a hash in a table of ``cap`` slots (any cap, not only powers of 2) */
static inline size_t
home_of(uint64_t hash, size_t cap)
{
    return (size_t)(((unsigned __int128)hash * cap) >> 64);
}

static inline size_t
next_slot(size_t i, size_t cap)
{
    return i + 1 == cap ? 0 : i + 1;
}

/* whether the entry at ``j`` whose home is ``h`` may move back to the emptied slot ``i``
 * (backward-shift deletion): ``h`` is not in the cyclic interval (i, j] */
static inline int
may_shift(size_t h, size_t i, size_t j)
{
    return i <= j ? (h <= i || h > j) : (h <= i && h > j);
}

static int
as_u64(PyObject *item, uint64_t *out)
{
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "block keys and hashes must be ints, not %.100s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "block keys and hashes must fit in 64 unsigned bits");
        return -1;
    }
    *out = (uint64_t)value;
    return 0;
}

/* ``seq`` as a C array of uint64 (PyMem_Malloc'd into *out, length returned; -1 on error) */
static Py_ssize_t
u64_array(PyObject *seq, uint64_t **out)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *buf = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (buf == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &buf[i]) != 0) {
            PyMem_Free(buf);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = buf;
    return n;
}

/* ------------------------------------------------------------------ ordered table */

/* Keys (and values) in insertion order with holes where entries were removed; ``slots``
 * index them (entry position + 1, 0 empty; at most 85% of them used). Holes are squeezed
 * out when the entry array is full and a quarter of it is holes, else it grows by an
 * eighth. */
typedef struct {
    uint64_t *keys;
    uint64_t *vals; /* NULL in a set */
    uint64_t *dead; /* bitmap over entry positions */
    uint32_t *slots;
    size_t n;     /* entries appended, holes included */
    size_t live;  /* entries held */
    size_t ecap;  /* entry capacity */
    size_t scap;  /* slot capacity */
    size_t first; /* no live entry before this position */
} OrdTable;

static inline int
ord_is_dead(const OrdTable *t, size_t p)
{
    return (int)((t->dead[p >> 6] >> (p & 63)) & 1u);
}

static void
ord_free(OrdTable *t)
{
    PyMem_Free(t->keys);
    PyMem_Free(t->vals);
    PyMem_Free(t->dead);
    PyMem_Free(t->slots);
    memset(t, 0, sizeof(*t));
}

static size_t
ord_bytes(const OrdTable *t, int with_vals)
{
    return t->ecap * sizeof(uint64_t) * (with_vals ? 2 : 1) + ((t->ecap + 63) / 64) * 8 +
           t->scap * sizeof(uint32_t);
}

/* the slot holding ``key``, or -1 */
static inline Py_ssize_t
ord_find(const OrdTable *t, uint64_t key)
{
    if (t->scap == 0) {
        return -1;
    }
    size_t i = home_of(mix64(key), t->scap);
    for (;;) {
        uint32_t p = t->slots[i];
        if (p == 0) {
            return -1;
        }
        if (t->keys[p - 1] == key) {
            return (Py_ssize_t)i;
        }
        i = next_slot(i, t->scap);
    }
}

static inline void
ord_slot_put(OrdTable *t, size_t pos)
{
    size_t i = home_of(mix64(t->keys[pos]), t->scap);
    while (t->slots[i] != 0) {
        i = next_slot(i, t->scap);
    }
    t->slots[i] = (uint32_t)(pos + 1);
}

static int
ord_reslot(OrdTable *t, size_t scap)
{
    uint32_t *slots = PyMem_Calloc(scap, sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->scap = scap;
    for (size_t p = t->first; p < t->n; p++) {
        if (!ord_is_dead(t, p)) {
            ord_slot_put(t, p);
        }
    }
    return 0;
}

static void
ord_slot_delete(OrdTable *t, size_t i)
{
    size_t j = i;
    for (;;) {
        j = next_slot(j, t->scap);
        uint32_t p = t->slots[j];
        if (p == 0) {
            break;
        }
        size_t h = home_of(mix64(t->keys[p - 1]), t->scap);
        if (may_shift(h, i, j)) {
            t->slots[i] = p;
            i = j;
        }
    }
    t->slots[i] = 0;
}

/* room to append one more entry; -1 with an exception set */
static int
ord_room(OrdTable *t, int with_vals)
{
    if (t->n == t->ecap) {
        if (t->n - t->live >= t->n / 4 && t->n - t->live > 0) {
            /* squeeze the holes out */
            size_t w = 0;
            for (size_t r = t->first; r < t->n; r++) {
                if (!ord_is_dead(t, r)) {
                    t->keys[w] = t->keys[r];
                    if (with_vals) {
                        t->vals[w] = t->vals[r];
                    }
                    w++;
                }
            }
            t->n = w;
            t->first = 0;
            memset(t->dead, 0, ((t->ecap + 63) / 64) * 8);
            if (ord_reslot(t, t->scap) != 0) {
                return -1;
            }
        } else {
            size_t ecap = t->ecap < 16 ? 16 : t->ecap + t->ecap / 8;
            uint64_t *keys = PyMem_Realloc(t->keys, ecap * sizeof(uint64_t));
            if (keys == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->keys = keys;
            if (with_vals) {
                uint64_t *vals = PyMem_Realloc(t->vals, ecap * sizeof(uint64_t));
                if (vals == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                t->vals = vals;
            }
            size_t old_words = (t->ecap + 63) / 64, words = (ecap + 63) / 64;
            uint64_t *dead = PyMem_Realloc(t->dead, words * 8);
            if (dead == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memset(dead + old_words, 0, (words - old_words) * 8);
            t->dead = dead;
            t->ecap = ecap;
        }
    }
    /* slots at most 85% full, rebuilt 70% full */
    if ((t->live + 1) * 20 > t->scap * 17) {
        size_t scap = (t->live + 1) * 10 / 7;
        if (scap < 16) {
            scap = 16;
        }
        if (ord_reslot(t, scap) != 0) {
            return -1;
        }
    }
    return 0;
}

/* remove the entry in slot ``i`` */
static void
ord_remove_slot(OrdTable *t, Py_ssize_t i)
{
    size_t p = t->slots[i] - 1;
    t->dead[p >> 6] |= (uint64_t)1 << (p & 63);
    ord_slot_delete(t, (size_t)i);
    t->live--;
    if (t->live == 0) {
        memset(t->dead, 0, ((t->n + 63) / 64) * 8);
        t->n = 0;
        t->first = 0;
    }
}

/* append ``key`` (-> ``val``), which is not held; -1 with an exception set */
static int
ord_append(OrdTable *t, uint64_t key, uint64_t val, int with_vals)
{
    if (ord_room(t, with_vals) != 0) {
        return -1;
    }
    size_t p = t->n++;
    t->keys[p] = key;
    if (with_vals) {
        t->vals[p] = val;
    }
    ord_slot_put(t, p);
    t->live++;
    return 0;
}

/* store ``key`` -> ``val`` as the newest when ``reorder`` or new (else the value is
 * replaced in place): 1 when it was not held, 0 when it was, -1 on error */
static int
ord_store(OrdTable *t, uint64_t key, uint64_t val, int with_vals, int reorder)
{
    Py_ssize_t i = ord_find(t, key);
    if (i >= 0) {
        if (!reorder) {
            if (with_vals) {
                t->vals[t->slots[i] - 1] = val;
            }
            return 0;
        }
        size_t p = t->slots[i] - 1;
        if (p + 1 == t->n) { /* already the newest */
            if (with_vals) {
                t->vals[p] = val;
            }
            return 0;
        }
        ord_remove_slot(t, i);
        return ord_append(t, key, val, with_vals) == 0 ? 0 : -1;
    }
    return ord_append(t, key, val, with_vals) == 0 ? 1 : -1;
}

/* the next live position at or after ``p`` */
static inline size_t
ord_next_live(const OrdTable *t, size_t p)
{
    while (p < t->n && ord_is_dead(t, p)) {
        p++;
    }
    return p;
}

/* ------------------------------------------------------------------ holder sets */

typedef struct {
    uint32_t refs;
    uint32_t len;
    uint64_t hash;
    uint32_t elem[];
} HolderSet;

typedef struct {
    uint32_t from, from_gen, elem, to, to_gen, add;
} MemoEntry;

/* ------------------------------------------------------------------ BlockIndex */

#pragma pack(push, 4)
typedef struct {
    uint64_t key;
    uint32_t set; /* 0: empty slot */
} KeySlot;
#pragma pack(pop)

/* an expiring record's deadline (seconds on the caller's clock) */
typedef struct {
    uint64_t key;
    uint32_t eid;
    uint32_t used;
    double deadline;
} ExpSlot;

/* a deadline to sweep at: the record is dropped then unless a later add moved it */
typedef struct {
    double deadline;
    uint64_t key;
    uint32_t eid;
} ExpRec;

typedef struct {
    PyObject_HEAD
    /* key table */
    KeySlot *table;
    size_t cap, used;
    /* holder sets; id 0 is the empty set */
    HolderSet **sets;
    uint32_t *gens;
    size_t nsets, sets_cap, live_sets;
    uint32_t *free_ids;
    size_t nfree;
    uint32_t *intern;
    size_t icap, iused;
    uint32_t *scratch;
    size_t scratch_cap;
    size_t set_bytes;
    MemoEntry memo[MEMO_SIZE];
    /* per engine id: firmly held keys per tier */
    OrdTable *held;
    size_t nengines; /* engine ids with tables */
    /* lookups */
    uint32_t *tag;
    uint32_t *alive;
    uint32_t *off;
    uint32_t *disk;
    uint32_t serial;
    /* sizes and bounds */
    size_t entries;      /* firm records */
    size_t slow_entries; /* firm records in the CPU and disk tiers */
    size_t max_entries, max_per_engine;
    unsigned long long evicted_engine_cap, evicted_index_cap;
    /* expiring records: (key, engine) -> deadline, and a heap of deadlines to sweep */
    ExpSlot *exp;
    size_t exp_cap, exp_used;
    ExpRec *heap;
    size_t heap_n, heap_cap;
    /* candidate object -> engine id, by identity: a lookup over 1,000 candidates spent
     * most of its time hashing each EngineKey tuple for the ids dict. Holds a reference
     * to each object (so its address is not reused while cached); flushed whenever the
     * caller's ids generation changes (an id was retired). Only found ids are cached. */
    PyObject **cc_obj;
    uint32_t *cc_id;
    size_t cc_cap, cc_used;
    unsigned long long cc_gen;
} BlockIndex;

static size_t
set_bytes_of(uint32_t len)
{
    return sizeof(HolderSet) + (size_t)len * sizeof(uint32_t);
}

static uint64_t
hash_elems(const uint32_t *elem, size_t len)
{
    return XXH3_64bits(elem, len * sizeof(uint32_t));
}

static int
intern_resize(BlockIndex *ix, size_t icap)
{
    uint32_t *tab = PyMem_Calloc(icap, sizeof(uint32_t));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < ix->icap; k++) {
        uint32_t id = ix->intern[k];
        if (id) {
            size_t i = home_of(ix->sets[id]->hash, icap);
            while (tab[i]) {
                i = next_slot(i, icap);
            }
            tab[i] = id;
        }
    }
    PyMem_Free(ix->intern);
    ix->intern = tab;
    ix->icap = icap;
    return 0;
}

static void
intern_delete(BlockIndex *ix, uint32_t id)
{
    uint64_t hash = ix->sets[id]->hash;
    size_t i = home_of(hash, ix->icap);
    while (ix->intern[i] != id) {
        i = next_slot(i, ix->icap);
    }
    size_t j = i;
    for (;;) {
        j = next_slot(j, ix->icap);
        uint32_t other = ix->intern[j];
        if (other == 0) {
            break;
        }
        if (may_shift(home_of(ix->sets[other]->hash, ix->icap), i, j)) {
            ix->intern[i] = other;
            i = j;
        }
    }
    ix->intern[i] = 0;
    ix->iused--;
}

static void
set_unref(BlockIndex *ix, uint32_t id)
{
    if (id == 0) {
        return;
    }
    HolderSet *s = ix->sets[id];
    if (--s->refs) {
        return;
    }
    intern_delete(ix, id);
    ix->set_bytes -= set_bytes_of(s->len);
    PyMem_Free(s);
    ix->sets[id] = NULL;
    ix->gens[id]++;
    ix->live_sets--;
    ix->free_ids[ix->nfree++] = id;
}

static inline void
set_ref(BlockIndex *ix, uint32_t id)
{
    if (id) {
        ix->sets[id]->refs++;
    }
}

/* the interned set with elements ``elem[0..len)`` (sorted); 0 for the empty set; its
 * refs are not taken; (uint32_t)-1 on error */
static uint32_t
set_intern(BlockIndex *ix, const uint32_t *elem, uint32_t len)
{
    if (len == 0) {
        return 0;
    }
    uint64_t hash = hash_elems(elem, len);
    if (ix->icap) {
        size_t i = home_of(hash, ix->icap);
        for (;;) {
            uint32_t id = ix->intern[i];
            if (id == 0) {
                break;
            }
            HolderSet *s = ix->sets[id];
            if (s->hash == hash && s->len == len && memcmp(s->elem, elem, len * sizeof(uint32_t)) == 0) {
                return id;
            }
            i = next_slot(i, ix->icap);
        }
    }
    if ((ix->iused + 1) * 10 > ix->icap * 7) {
        if (intern_resize(ix, ix->icap < 64 ? 128 : ix->icap * 2) != 0) {
            return (uint32_t)-1;
        }
    }
    uint32_t id;
    if (ix->nfree) {
        id = ix->free_ids[--ix->nfree];
    } else {
        if (ix->nsets == ix->sets_cap) {
            size_t cap = ix->sets_cap < 64 ? 64 : ix->sets_cap * 2;
            if (cap > 0xFFFFFFF0u) {
                PyErr_SetString(PyExc_MemoryError, "too many holder sets");
                return (uint32_t)-1;
            }
            HolderSet **sets = PyMem_Realloc(ix->sets, cap * sizeof(HolderSet *));
            if (sets == NULL) {
                PyErr_NoMemory();
                return (uint32_t)-1;
            }
            ix->sets = sets;
            uint32_t *gens = PyMem_Realloc(ix->gens, cap * sizeof(uint32_t));
            if (gens == NULL) {
                PyErr_NoMemory();
                return (uint32_t)-1;
            }
            ix->gens = gens;
            uint32_t *free_ids = PyMem_Realloc(ix->free_ids, cap * sizeof(uint32_t));
            if (free_ids == NULL) {
                PyErr_NoMemory();
                return (uint32_t)-1;
            }
            ix->free_ids = free_ids;
            for (size_t k = ix->sets_cap; k < cap; k++) {
                ix->sets[k] = NULL;
                ix->gens[k] = 0;
            }
            ix->sets_cap = cap;
        }
        id = (uint32_t)ix->nsets++;
    }
    HolderSet *s = PyMem_Malloc(set_bytes_of(len));
    if (s == NULL) {
        ix->free_ids[ix->nfree++] = id;
        PyErr_NoMemory();
        return (uint32_t)-1;
    }
    s->refs = 0;
    s->len = len;
    s->hash = hash;
    memcpy(s->elem, elem, len * sizeof(uint32_t));
    ix->sets[id] = s;
    ix->set_bytes += set_bytes_of(len);
    ix->live_sets++;
    size_t i = home_of(hash, ix->icap);
    while (ix->intern[i]) {
        i = next_slot(i, ix->icap);
    }
    ix->intern[i] = id;
    ix->iused++;
    return id;
}

/* first position in set ``s`` whose element is >= ``elem`` */
static inline uint32_t
set_lower(const HolderSet *s, uint32_t elem)
{
    uint32_t lo = 0, hi = s->len;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1;
        if (s->elem[mid] < elem) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* set ``from`` with ``elem`` added (``add``) or taken out; (uint32_t)-1 on error */
static uint32_t
set_edit(BlockIndex *ix, uint32_t from, uint32_t elem, int add)
{
    MemoEntry *m = &ix->memo[(from * 2654435761u ^ elem * 40503u ^ (uint32_t)add) & (MEMO_SIZE - 1)];
    if (m->from == from && m->elem == elem && m->add == (uint32_t)add && m->from_gen == ix->gens[from] &&
        (m->to == 0 || (ix->sets[m->to] != NULL && ix->gens[m->to] == m->to_gen))) {
        return m->to;
    }
    const HolderSet *s = from ? ix->sets[from] : NULL;
    uint32_t len = s ? s->len : 0;
    uint32_t at = s ? set_lower(s, elem) : 0;
    int present = s && at < len && s->elem[at] == elem;
    uint32_t to;
    if (add == present) {
        to = from;
    } else {
        size_t need = (size_t)len + 1;
        if (need > ix->scratch_cap) {
            uint32_t *buf = PyMem_Realloc(ix->scratch, need * 2 * sizeof(uint32_t));
            if (buf == NULL) {
                PyErr_NoMemory();
                return (uint32_t)-1;
            }
            ix->scratch = buf;
            ix->scratch_cap = need * 2;
        }
        uint32_t *out = ix->scratch, n = 0;
        if (s) {
            memcpy(out, s->elem, at * sizeof(uint32_t));
        }
        n = at;
        if (add) {
            out[n++] = elem;
            if (s) {
                memcpy(out + n, s->elem + at, (len - at) * sizeof(uint32_t));
            }
            n += len - at;
        } else {
            memcpy(out + n, s->elem + at + 1, (len - at - 1) * sizeof(uint32_t));
            n += len - at - 1;
        }
        to = set_intern(ix, out, n);
        if (to == (uint32_t)-1) {
            return to;
        }
    }
    {
        m->from = from;
        m->from_gen = ix->gens[from];
        m->elem = elem;
        m->add = (uint32_t)add;
        m->to = to;
        m->to_gen = to ? ix->gens[to] : 0;
    }
    return to;
}

/* --- key table */

static inline Py_ssize_t
key_find(const BlockIndex *ix, uint64_t key)
{
    if (ix->cap == 0) {
        return -1;
    }
    size_t i = home_of(mix64(key), ix->cap);
    for (;;) {
        const KeySlot *slot = &ix->table[i];
        if (slot->set == 0) {
            return -1;
        }
        if (slot->key == key) {
            return (Py_ssize_t)i;
        }
        i = next_slot(i, ix->cap);
    }
}

static int
key_table_resize(BlockIndex *ix, size_t cap)
{
    KeySlot *table = PyMem_Calloc(cap, sizeof(KeySlot));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < ix->cap; k++) {
        if (ix->table[k].set) {
            size_t i = home_of(mix64(ix->table[k].key), cap);
            while (table[i].set) {
                i = next_slot(i, cap);
            }
            table[i] = ix->table[k];
        }
    }
    PyMem_Free(ix->table);
    ix->table = table;
    ix->cap = cap;
    return 0;
}

static void
key_delete(BlockIndex *ix, size_t i)
{
    size_t j = i;
    for (;;) {
        j = next_slot(j, ix->cap);
        if (ix->table[j].set == 0) {
            break;
        }
        if (may_shift(home_of(mix64(ix->table[j].key), ix->cap), i, j)) {
            ix->table[i] = ix->table[j];
            i = j;
        }
    }
    ix->table[i].set = 0;
    ix->used--;
}

/* add (``add``) or take ``elem`` out of ``key``'s holders: 1 changed, 0 not, -1 error */
static int
key_edit(BlockIndex *ix, uint64_t key, uint32_t elem, int add)
{
    Py_ssize_t i = key_find(ix, key);
    uint32_t from = i >= 0 ? ix->table[i].set : 0;
    if (i < 0 && !add) {
        return 0;
    }
    uint32_t to = set_edit(ix, from, elem, add);
    if (to == (uint32_t)-1) {
        return -1;
    }
    if (to == from) {
        return 0;
    }
    set_ref(ix, to);
    if (i < 0) {
        if ((ix->used + 1) * 20 > ix->cap * 17) {
            size_t cap = ix->cap < 64 ? 128 : ix->cap + ix->cap / 3;
            if (key_table_resize(ix, cap) != 0) {
                set_unref(ix, to);
                return -1;
            }
        }
        size_t k = home_of(mix64(key), ix->cap);
        while (ix->table[k].set) {
            k = next_slot(k, ix->cap);
        }
        ix->table[k].key = key;
        ix->table[k].set = to;
        ix->used++;
        return 1;
    }
    set_unref(ix, from);
    if (to == 0) {
        key_delete(ix, (size_t)i);
    } else {
        ix->table[i].set = to;
    }
    return 1;
}

/* --- engines */

static int
ensure_engine(BlockIndex *ix, Py_ssize_t eid)
{
    if (eid < 0 || eid >= (1 << 29)) {
        PyErr_SetString(PyExc_ValueError, "engine id out of range");
        return -1;
    }
    if ((size_t)eid < ix->nengines) {
        return 0;
    }
    size_t n = ix->nengines < 16 ? 16 : ix->nengines;
    while (n <= (size_t)eid) {
        n *= 2;
    }
    OrdTable *held = PyMem_Realloc(ix->held, n * TIERS * sizeof(OrdTable));
    if (held == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(held + ix->nengines * TIERS, 0, (n - ix->nengines) * TIERS * sizeof(OrdTable));
    ix->held = held;
    uint32_t **arrays[] = {&ix->tag, &ix->alive, &ix->off, &ix->disk};
    for (size_t a = 0; a < 4; a++) {
        uint32_t *buf = PyMem_Realloc(*arrays[a], n * sizeof(uint32_t));
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(buf + ix->nengines, 0, (n - ix->nengines) * sizeof(uint32_t));
        *arrays[a] = buf;
    }
    ix->nengines = n;
    return 0;
}

static inline OrdTable *
held_of(BlockIndex *ix, size_t eid, int tier)
{
    return &ix->held[eid * TIERS + (size_t)tier];
}

static inline uint32_t
elem_of(size_t eid, uint32_t code)
{
    return (uint32_t)(eid << 2) | code;
}

/* forget firm record (eid, tier, key), held in slot ``i`` of its table; -1 on error */
static int
drop_firm(BlockIndex *ix, size_t eid, int tier, uint64_t key, Py_ssize_t i)
{
    OrdTable *t = held_of(ix, eid, tier);
    ord_remove_slot(t, i);
    ix->entries--;
    if (tier != 0) {
        ix->slow_entries--;
    }
    return key_edit(ix, key, elem_of(eid, (uint32_t)tier), 0) < 0 ? -1 : 0;
}

/* evict ``count`` least recently stored records of (eid, tier); -1 on error */
static int
evict_oldest(BlockIndex *ix, size_t eid, int tier, size_t count, unsigned long long *counter)
{
    OrdTable *t = held_of(ix, eid, tier);
    while (count-- && t->live) {
        size_t p = ord_next_live(t, t->first);
        t->first = p;
        uint64_t key = t->keys[p];
        Py_ssize_t i = ord_find(t, key);
        if (drop_firm(ix, eid, tier, key, i) != 0) {
            return -1;
        }
        (*counter)++;
    }
    return 0;
}

static size_t
trimmed(size_t cap)
{
    size_t a = cap - cap / 8, b = cap - 1;
    return a < b ? a : b;
}

static int
make_room(BlockIndex *ix, size_t eid, int tier)
{
    OrdTable *t = held_of(ix, eid, tier);
    size_t cap = ix->max_per_engine;
    if (cap && t->live > cap) {
        if (evict_oldest(ix, eid, tier, t->live - trimmed(cap), &ix->evicted_engine_cap) != 0) {
            return -1;
        }
    }
    cap = ix->max_entries;
    if (!cap || ix->entries <= cap) {
        return 0;
    }
    size_t target = trimmed(cap);
    while (ix->entries > target) {
        size_t most = 0, which = 0;
        for (size_t k = 0; k < ix->nengines * TIERS; k++) {
            if (ix->held[k].live > most) {
                most = ix->held[k].live;
                which = k;
            }
        }
        if (most == 0) {
            return 0;
        }
        size_t share = most / 8 ? most / 8 : 1;
        if (share > ix->entries - target) {
            share = ix->entries - target;
        }
        if (evict_oldest(ix, which / TIERS, (int)(which % TIERS), share, &ix->evicted_index_cap) != 0) {
            return -1;
        }
    }
    return 0;
}

static int
parse_tier(int tier)
{
    if (tier < 0 || tier >= TIERS) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0 (GPU), 1 (CPU) or 2 (disk)");
        return -1;
    }
    return 0;
}

/* add(engine_id, tier, keys) -> firm records new to the index */
static PyObject *
BlockIndex_add(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    int tier;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "niO:add", &eid, &tier, &seq) || parse_tier(tier) != 0 ||
        ensure_engine(ix, eid) != 0) {
        return NULL;
    }
    uint64_t *keys;
    Py_ssize_t n = u64_array(seq, &keys);
    if (n < 0) {
        return NULL;
    }
    /* Bounded, the batch's keys become the newest, in the order of their first
     * occurrence (as popping them all and then storing them does): take the held ones
     * out first, remembering which were held. */
    const int reorder = ix->max_entries || ix->max_per_engine;
    OrdTable *held = held_of(ix, (size_t)eid, tier);
    char *was = NULL;
    if (reorder && held->live) {
        was = PyMem_Calloc((size_t)(n ? n : 1), 1);
        if (was == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            Py_ssize_t i = ord_find(held, keys[k]);
            if (i >= 0) {
                ord_remove_slot(held, i);
                was[k] = 1;
            }
        }
    }
    size_t fresh = 0;
    const uint32_t firm = elem_of((size_t)eid, (uint32_t)tier);
    const uint32_t expiring = elem_of((size_t)eid, CODE_EXPIRING);
    for (Py_ssize_t k = 0; k < n; k++) {
        int added = ord_store(held, keys[k], 0, 0, 0);
        if (added < 0) {
            PyMem_Free(was);
            goto fail;
        }
        if (added && !(was && was[k])) {
            fresh++;
            ix->entries++;
            if (tier != 0) {
                ix->slow_entries++;
            }
            if (key_edit(ix, keys[k], firm, 1) < 0 ||
                (tier == 0 && key_edit(ix, keys[k], expiring, 0) < 0)) {
                PyMem_Free(was);
                goto fail;
            }
        }
    }
    PyMem_Free(was);
    PyMem_Free(keys);
    if (make_room(ix, (size_t)eid, tier) != 0) {
        return NULL;
    }
    return PyLong_FromSize_t(fresh);
fail:
    PyMem_Free(keys);
    return NULL;
}

/* --- expiring records */

static inline uint64_t
exp_hash(uint64_t key, uint32_t eid)
{
    return mix64(key ^ ((uint64_t)eid * 0x9E3779B97F4A7C15ULL));
}

static Py_ssize_t
exp_find(const BlockIndex *ix, uint64_t key, uint32_t eid)
{
    if (ix->exp_cap == 0) {
        return -1;
    }
    size_t i = home_of(exp_hash(key, eid), ix->exp_cap);
    for (;;) {
        const ExpSlot *slot = &ix->exp[i];
        if (!slot->used) {
            return -1;
        }
        if (slot->key == key && slot->eid == eid) {
            return (Py_ssize_t)i;
        }
        i = next_slot(i, ix->exp_cap);
    }
}

static int
exp_resize(BlockIndex *ix, size_t cap)
{
    ExpSlot *table = PyMem_Calloc(cap, sizeof(ExpSlot));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < ix->exp_cap; k++) {
        if (ix->exp[k].used) {
            size_t i = home_of(exp_hash(ix->exp[k].key, ix->exp[k].eid), cap);
            while (table[i].used) {
                i = next_slot(i, cap);
            }
            table[i] = ix->exp[k];
        }
    }
    PyMem_Free(ix->exp);
    ix->exp = table;
    ix->exp_cap = cap;
    return 0;
}

static void
exp_delete(BlockIndex *ix, size_t i)
{
    size_t j = i;
    for (;;) {
        j = next_slot(j, ix->exp_cap);
        if (!ix->exp[j].used) {
            break;
        }
        if (may_shift(home_of(exp_hash(ix->exp[j].key, ix->exp[j].eid), ix->exp_cap), i, j)) {
            ix->exp[i] = ix->exp[j];
            i = j;
        }
    }
    ix->exp[i].used = 0;
    ix->exp_used--;
}

/* (key, eid) expires at ``deadline`` (a later add moves it): 1 when it needs a heap
 * entry (new, or moved earlier than its entry's), 0 when not, -1 on error */
static int
exp_put(BlockIndex *ix, uint64_t key, uint32_t eid, double deadline)
{
    Py_ssize_t i = exp_find(ix, key, eid);
    if (i >= 0) {
        int earlier = deadline < ix->exp[i].deadline;
        ix->exp[i].deadline = deadline;
        return earlier;
    }
    if ((ix->exp_used + 1) * 5 > ix->exp_cap * 4) {
        if (exp_resize(ix, ix->exp_cap < 64 ? 128 : ix->exp_cap + ix->exp_cap / 2) != 0) {
            return -1;
        }
    }
    size_t k = home_of(exp_hash(key, eid), ix->exp_cap);
    while (ix->exp[k].used) {
        k = next_slot(k, ix->exp_cap);
    }
    ix->exp[k].key = key;
    ix->exp[k].eid = eid;
    ix->exp[k].used = 1;
    ix->exp[k].deadline = deadline;
    ix->exp_used++;
    return 1;
}

static int
heap_push(BlockIndex *ix, double deadline, uint64_t key, uint32_t eid)
{
    if (ix->heap_n == ix->heap_cap) {
        size_t cap = ix->heap_cap < 64 ? 128 : ix->heap_cap + ix->heap_cap / 2;
        ExpRec *heap = PyMem_Realloc(ix->heap, cap * sizeof(ExpRec));
        if (heap == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ix->heap = heap;
        ix->heap_cap = cap;
    }
    size_t i = ix->heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (ix->heap[up].deadline <= deadline) {
            break;
        }
        ix->heap[i] = ix->heap[up];
        i = up;
    }
    ix->heap[i].deadline = deadline;
    ix->heap[i].key = key;
    ix->heap[i].eid = eid;
    return 0;
}

static ExpRec
heap_pop(BlockIndex *ix)
{
    ExpRec top = ix->heap[0];
    ExpRec last = ix->heap[--ix->heap_n];
    size_t i = 0, n = ix->heap_n;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= n) {
            break;
        }
        if (child + 1 < n && ix->heap[child + 1].deadline < ix->heap[child].deadline) {
            child++;
        }
        if (last.deadline <= ix->heap[child].deadline) {
            break;
        }
        ix->heap[i] = ix->heap[child];
        i = child;
    }
    if (n) {
        ix->heap[i] = last;
    }
    if (n == 0 && ix->heap_cap > 1024) { /* let a burst's heap go */
        PyMem_Free(ix->heap);
        ix->heap = NULL;
        ix->heap_cap = 0;
    }
    return top;
}

/* drop every expiring record whose deadline is at or before ``now``; -1 on error */
static int
sweep_to(BlockIndex *ix, double now)
{
    while (ix->heap_n && ix->heap[0].deadline <= now) {
        ExpRec rec = heap_pop(ix);
        Py_ssize_t i = exp_find(ix, rec.key, rec.eid);
        if (i < 0) {
            continue; /* removed since */
        }
        if (ix->exp[i].deadline > now) { /* moved later by another add: due then */
            if (heap_push(ix, ix->exp[i].deadline, rec.key, rec.eid) != 0) {
                return -1;
            }
            continue;
        }
        exp_delete(ix, (size_t)i);
        if (key_edit(ix, rec.key, elem_of(rec.eid, CODE_EXPIRING), 0) < 0) {
            return -1;
        }
    }
    if (ix->exp_used == 0 && ix->exp_cap > 1024) {
        PyMem_Free(ix->exp);
        ix->exp = NULL;
        ix->exp_cap = 0;
    }
    return 0;
}

/* forget (key, eid)'s expiring record, if any; -1 on error */
static int
drop_expiring(BlockIndex *ix, uint64_t key, uint32_t eid)
{
    Py_ssize_t i = exp_find(ix, key, eid);
    if (i >= 0) {
        exp_delete(ix, (size_t)i);
    }
    return key_edit(ix, key, elem_of(eid, CODE_EXPIRING), 0) < 0 ? -1 : 0;
}

/* add_expiring(engine_id, keys, deadline): the engine holds ``keys`` on the GPU until
 * ``deadline``, those it holds there firmly aside (a later add moves a deadline) */
static PyObject *
BlockIndex_add_expiring(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    PyObject *seq;
    double deadline;
    if (!PyArg_ParseTuple(args, "nOd:add_expiring", &eid, &seq, &deadline) ||
        ensure_engine(ix, eid) != 0) {
        return NULL;
    }
    uint64_t *keys;
    Py_ssize_t n = u64_array(seq, &keys); /* every key checked before any is applied */
    if (n < 0) {
        return NULL;
    }
    OrdTable *gpu = held_of(ix, (size_t)eid, 0);
    const uint32_t expiring = elem_of((size_t)eid, CODE_EXPIRING);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ord_find(gpu, keys[k]) >= 0) {
            continue;
        }
        /* one heap entry per record: a moved deadline is found when the old one is due */
        int fresh = key_edit(ix, keys[k], expiring, 1) < 0 ? -1 : exp_put(ix, keys[k], (uint32_t)eid, deadline);
        if (fresh < 0 || (fresh && heap_push(ix, deadline, keys[k], (uint32_t)eid) != 0)) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

/* sweep(now): drop the expiring records whose deadline is at or before ``now`` */
static PyObject *
BlockIndex_sweep(BlockIndex *ix, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (sweep_to(ix, now) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* remove(engine_id, tier, keys) -> firm records removed; tier -1: every tier; the GPU
 * tier's removal takes expiring records too */
static PyObject *
BlockIndex_remove(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    int tier;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "niO:remove", &eid, &tier, &seq)) {
        return NULL;
    }
    if (tier != -1 && parse_tier(tier) != 0) {
        return NULL;
    }
    if (ensure_engine(ix, eid) != 0) {
        return NULL;
    }
    uint64_t *keys;
    Py_ssize_t n = u64_array(seq, &keys);
    if (n < 0) {
        return NULL;
    }
    size_t gone = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        for (int t = 0; t < TIERS; t++) {
            if (tier != -1 && tier != t) {
                continue;
            }
            OrdTable *table = held_of(ix, (size_t)eid, t);
            Py_ssize_t i = ord_find(table, keys[k]);
            if (i >= 0) {
                if (drop_firm(ix, (size_t)eid, t, keys[k], i) != 0) {
                    PyMem_Free(keys);
                    return NULL;
                }
                gone++;
            }
            if (t == 0 && drop_expiring(ix, keys[k], (uint32_t)eid) != 0) {
                PyMem_Free(keys);
                return NULL;
            }
        }
    }
    PyMem_Free(keys);
    return PyLong_FromSize_t(gone);
}

/* clear(engine_id) -> firm records removed; its expiring ones go too */
static PyObject *
BlockIndex_clear(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    if (!PyArg_ParseTuple(args, "n:clear", &eid) || ensure_engine(ix, eid) != 0) {
        return NULL;
    }
    /* its expiring records: collected first (deleting shifts the table), then dropped;
     * their heap entries find nothing when they come due */
    size_t mine = 0;
    for (size_t k = 0; k < ix->exp_cap; k++) {
        mine += ix->exp[k].used && ix->exp[k].eid == (uint32_t)eid;
    }
    if (mine) {
        uint64_t *keys = PyMem_Malloc(mine * sizeof(uint64_t));
        if (keys == NULL) {
            return PyErr_NoMemory();
        }
        size_t n = 0;
        for (size_t k = 0; k < ix->exp_cap; k++) {
            if (ix->exp[k].used && ix->exp[k].eid == (uint32_t)eid) {
                keys[n++] = ix->exp[k].key;
            }
        }
        for (size_t k = 0; k < n; k++) {
            if (drop_expiring(ix, keys[k], (uint32_t)eid) != 0) {
                PyMem_Free(keys);
                return NULL;
            }
        }
        PyMem_Free(keys);
    }
    size_t gone = 0;
    for (int t = 0; t < TIERS; t++) {
        OrdTable *table = held_of(ix, (size_t)eid, t);
        const uint32_t elem = elem_of((size_t)eid, (uint32_t)t);
        for (size_t p = table->first; p < table->n; p++) {
            if (!ord_is_dead(table, p)) {
                if (key_edit(ix, table->keys[p], elem, 0) < 0) {
                    return NULL;
                }
                gone++;
            }
        }
        ix->entries -= table->live;
        if (t != 0) {
            ix->slow_entries -= table->live;
        }
        ord_free(table);
    }
    return PyLong_FromSize_t(gone);
}

/* held(engine_id, tier) -> how many keys the engine holds firmly in ``tier`` */
static PyObject *
BlockIndex_held(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    int tier;
    if (!PyArg_ParseTuple(args, "ni:held", &eid, &tier) || parse_tier(tier) != 0) {
        return NULL;
    }
    if (eid < 0 || (size_t)eid >= ix->nengines) {
        return PyLong_FromLong(0);
    }
    return PyLong_FromSize_t(held_of(ix, (size_t)eid, tier)->live);
}

/* held_keys(engine_id, tier) -> the keys, oldest stored first */
static PyObject *
BlockIndex_held_keys(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    int tier;
    if (!PyArg_ParseTuple(args, "ni:held_keys", &eid, &tier) || parse_tier(tier) != 0) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL || eid < 0 || (size_t)eid >= ix->nengines) {
        return out;
    }
    OrdTable *t = held_of(ix, (size_t)eid, tier);
    for (size_t p = t->first; p < t->n; p++) {
        if (!ord_is_dead(t, p)) {
            PyObject *v = PyLong_FromUnsignedLongLong(t->keys[p]);
            if (v == NULL || PyList_Append(out, v) != 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return out;
}

/* held_union(engine_id) -> distinct keys the engine holds firmly in any tier */
static PyObject *
BlockIndex_held_union(BlockIndex *ix, PyObject *args)
{
    Py_ssize_t eid;
    if (!PyArg_ParseTuple(args, "n:held_union", &eid)) {
        return NULL;
    }
    if (eid < 0 || (size_t)eid >= ix->nengines) {
        return PyLong_FromLong(0);
    }
    size_t count = 0;
    for (int t = 0; t < TIERS; t++) {
        OrdTable *table = held_of(ix, (size_t)eid, t);
        for (size_t p = table->first; p < table->n; p++) {
            if (ord_is_dead(table, p)) {
                continue;
            }
            int earlier = 0;
            for (int u = 0; u < t; u++) {
                earlier |= ord_find(held_of(ix, (size_t)eid, u), table->keys[p]) >= 0;
            }
            count += !earlier;
        }
    }
    return PyLong_FromSize_t(count);
}

/* holders(key) -> [(engine_id, code)] of every record of ``key`` (code 3: expiring) */
static PyObject *
BlockIndex_holders(BlockIndex *ix, PyObject *obj)
{
    uint64_t key;
    if (as_u64(obj, &key) != 0) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    Py_ssize_t i = key_find(ix, key);
    if (out == NULL || i < 0) {
        return out;
    }
    const HolderSet *s = ix->sets[ix->table[i].set];
    for (uint32_t k = 0; k < s->len; k++) {
        PyObject *pair = Py_BuildValue("(II)", s->elem[k] >> 2, s->elem[k] & 3u);
        if (pair == NULL || PyList_Append(out, pair) != 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

/* close a run of ``len`` keys held by set ``sid``: the alive engines' CPU and disk counts */
static void
count_run(BlockIndex *ix, uint32_t sid, uint32_t t, uint32_t len)
{
    if (sid == 0 || len == 0) {
        return;
    }
    const HolderSet *s = ix->sets[sid];
    uint32_t k = 0;
    while (k < s->len) {
        uint32_t e = s->elem[k] >> 2;
        int gpu = 0, cpu = 0;
        for (; k < s->len && (s->elem[k] >> 2) == e; k++) {
            uint32_t code = s->elem[k] & 3u;
            gpu |= code == CODE_GPU || code == CODE_EXPIRING;
            cpu |= code == CODE_CPU;
        }
        if (ix->tag[e] == t && !gpu) {
            ix->off[e] += len;
            if (!cpu) {
                ix->disk[e] += len;
            }
        }
    }
}

static void
cc_flush(BlockIndex *ix)
{
    for (size_t k = 0; k < ix->cc_cap; k++) {
        Py_CLEAR(ix->cc_obj[k]);
    }
    ix->cc_used = 0;
}

static inline size_t
cc_slot(const PyObject *obj, size_t mask)
{
    uint64_t h = (uint64_t)(uintptr_t)obj * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & mask;
}

/* The engine id of candidate ``obj`` through the identity cache, else ``ids``; -1 when
 * it has none (or it is out of range), -2 on error. */
static Py_ssize_t
cc_resolve(BlockIndex *ix, PyObject *ids, PyObject *obj)
{
    if (ix->cc_cap) {
        size_t mask = ix->cc_cap - 1;
        for (size_t i = cc_slot(obj, mask);; i = (i + 1) & mask) {
            PyObject *o = ix->cc_obj[i];
            if (o == obj) {
                return (Py_ssize_t)ix->cc_id[i];
            }
            if (o == NULL) {
                break;
            }
        }
    }
    PyObject *id = PyDict_GetItemWithError(ids, obj);
    if (id == NULL) {
        return PyErr_Occurred() ? -2 : -1;
    }
    Py_ssize_t e = PyLong_AsSsize_t(id);
    if (e < 0 || (size_t)e >= ix->nengines) {
        return PyErr_Occurred() ? -2 : -1;
    }
    if (2 * (ix->cc_used + 1) > ix->cc_cap) {
        size_t cap = ix->cc_cap ? 2 * ix->cc_cap : 1024;
        if (cap > ((size_t)1 << 20)) { /* that many distinct objects: start over */
            cc_flush(ix);
            cap = ix->cc_cap;
        }
        if (cap != ix->cc_cap) {
            PyObject **objs = PyMem_Calloc(cap, sizeof(PyObject *));
            uint32_t *cids = PyMem_Calloc(cap, sizeof(uint32_t));
            if (objs == NULL || cids == NULL) {
                PyMem_Free(objs);
                PyMem_Free(cids);
                return e; /* not cached: still a valid answer */
            }
            for (size_t k = 0; k < ix->cc_cap; k++) {
                PyObject *o = ix->cc_obj[k];
                if (o != NULL) {
                    size_t i = cc_slot(o, cap - 1);
                    while (objs[i] != NULL) {
                        i = (i + 1) & (cap - 1);
                    }
                    objs[i] = o;
                    cids[i] = ix->cc_id[k];
                }
            }
            PyMem_Free(ix->cc_obj);
            PyMem_Free(ix->cc_id);
            ix->cc_obj = objs;
            ix->cc_id = cids;
            ix->cc_cap = cap;
        }
    }
    size_t mask = ix->cc_cap - 1;
    size_t i = cc_slot(obj, mask);
    while (ix->cc_obj[i] != NULL) {
        i = (i + 1) & mask;
    }
    Py_INCREF(obj);
    ix->cc_obj[i] = obj;
    ix->cc_id[i] = (uint32_t)e;
    ix->cc_used++;
    return e;
}

/* lookup(keys, candidates, ids, names, match[, generation])
 *     -> {name: match(depth, offloaded, disk)}
 *
 * ``ids`` maps a candidate to its engine id (candidates it lacks match nothing),
 * ``names[id]`` is the result's key for an engine and ``match`` the type built. With
 * ``generation``, candidates' ids are cached by object identity until a call passes
 * another generation: the caller changes it whenever a mapping of ``ids`` changes or
 * goes (adding mappings needs no change: only found ids are cached). */
static PyObject *
BlockIndex_lookup(BlockIndex *ix, PyObject *args)
{
    PyObject *keys_obj, *cands_obj, *ids, *names, *match, *gen_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OOO!O!O|O:lookup", &keys_obj, &cands_obj, &PyDict_Type, &ids,
                          &PyList_Type, &names, &match, &gen_obj)) {
        return NULL;
    }
    int cached = gen_obj != Py_None;
    if (cached) {
        unsigned long long gen = PyLong_AsUnsignedLongLong(gen_obj);
        if (gen == (unsigned long long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (gen != ix->cc_gen) {
            cc_flush(ix);
            ix->cc_gen = gen;
        }
    }
    PyObject *result = PyDict_New();
    if (result == NULL) {
        return NULL;
    }
    if (ix->used == 0 || ix->nengines == 0) {
        return result;
    }
    PyObject *cands = PySequence_Fast(cands_obj, "candidates must be a sequence");
    if (cands == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (keys == NULL) {
        Py_DECREF(cands);
        Py_DECREF(result);
        return NULL;
    }
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(keys);
    if (ix->serial > 0xFFFFFFF0u - 2 * (uint32_t)(nk < 0x10000000 ? nk : 0x10000000) - 4) {
        memset(ix->tag, 0, ix->nengines * sizeof(uint32_t)); /* tags start over */
        ix->serial = 0;
    }
    uint32_t t = ++ix->serial;
    size_t na = 0;
    Py_ssize_t nc = PySequence_Fast_GET_SIZE(cands);
    PyObject **citems = PySequence_Fast_ITEMS(cands);
    for (Py_ssize_t c = 0; c < nc; c++) {
        Py_ssize_t e;
        if (cached) {
            e = cc_resolve(ix, ids, citems[c]);
        } else {
            PyObject *id = PyDict_GetItemWithError(ids, citems[c]);
            e = id == NULL ? -1 : PyLong_AsSsize_t(id);
            if (e < 0 || (size_t)e >= ix->nengines) {
                e = PyErr_Occurred() ? -2 : -1;
            }
        }
        if (e == -2) {
            goto fail;
        }
        if (e < 0) {
            continue;
        }
        if (ix->tag[e] != t) {
            ix->tag[e] = t;
            ix->off[e] = ix->disk[e] = 0;
            ix->alive[na++] = (uint32_t)e;
        }
    }
    PyObject **kitems = PySequence_Fast_ITEMS(keys);
    const int tiers = ix->slow_entries > 0;
    uint32_t prev = (uint32_t)-1, run_start = 0;
    Py_ssize_t pos = 0;
    /* engines that fell out, with their depth, in the order they did */
    uint32_t *dead_e = NULL, *dead_d = NULL;
    size_t ndead = 0;
    if (na) {
        dead_e = PyMem_Malloc(na * sizeof(uint32_t));
        dead_d = PyMem_Malloc(na * sizeof(uint32_t));
        if (dead_e == NULL || dead_d == NULL) {
            PyErr_NoMemory();
            goto fail_dead;
        }
    }
    for (pos = 0; pos < nk && na; pos++) {
        uint64_t key;
        if (as_u64(kitems[pos], &key) != 0) {
            goto fail_dead;
        }
        Py_ssize_t i = key_find(ix, key);
        uint32_t sid = i >= 0 ? ix->table[i].set : 0;
        if (sid == prev) {
            continue;
        }
        if (tiers && prev != (uint32_t)-1) {
            count_run(ix, prev, t, (uint32_t)pos - run_start);
        }
        uint32_t t2 = ++ix->serial; /* room made before the walk */
        if (sid) {
            const HolderSet *s = ix->sets[sid];
            if (s->len <= na * 4) {
                for (uint32_t k = 0; k < s->len; k++) {
                    uint32_t e = s->elem[k] >> 2;
                    if (ix->tag[e] == t) {
                        ix->tag[e] = t2;
                    }
                }
            } else {
                for (size_t a = 0; a < na; a++) {
                    uint32_t e = ix->alive[a];
                    uint32_t at = set_lower(s, e << 2);
                    if (at < s->len && (s->elem[at] >> 2) == e) {
                        ix->tag[e] = t2;
                    }
                }
            }
        }
        size_t kept = 0;
        for (size_t a = 0; a < na; a++) {
            uint32_t e = ix->alive[a];
            if (ix->tag[e] == t2) {
                ix->alive[kept++] = e;
            } else if (pos) {
                ix->tag[e] = 0; /* out: keeps its counts */
                dead_e[ndead] = e;
                dead_d[ndead++] = (uint32_t)pos;
            }
        }
        na = kept;
        t = t2;
        prev = sid;
        run_start = (uint32_t)pos;
    }
    if (tiers && na && prev != (uint32_t)-1) {
        count_run(ix, prev, t, (uint32_t)pos - run_start);
    }
    for (size_t a = 0; a < na; a++) {
        dead_e[ndead] = ix->alive[a];
        dead_d[ndead++] = (uint32_t)pos;
    }
    for (size_t k = 0; k < ndead; k++) {
        uint32_t e = dead_e[k];
        if ((Py_ssize_t)e >= PyList_GET_SIZE(names)) {
            continue;
        }
        PyObject *name = PyList_GET_ITEM(names, e);
        PyObject *argv[3] = {PyLong_FromUnsignedLong(dead_d[k]), NULL, NULL};
        size_t argc = 1; /* match(depth): no block in a slower tier */
        if (tiers && ix->off[e]) {
            argv[1] = PyLong_FromUnsignedLong(ix->off[e]);
            argv[2] = PyLong_FromUnsignedLong(ix->disk[e]);
            argc = 3;
        }
        PyObject *m = NULL;
        if (argv[0] != NULL && (argc == 1 || (argv[1] != NULL && argv[2] != NULL))) {
            m = PyObject_Vectorcall(match, argv, argc, NULL);
        }
        Py_XDECREF(argv[0]);
        Py_XDECREF(argv[1]);
        Py_XDECREF(argv[2]);
        if (m == NULL || PyDict_SetItem(result, name, m) != 0) {
            Py_XDECREF(m);
            goto fail_dead;
        }
        Py_DECREF(m);
    }
    PyMem_Free(dead_e);
    PyMem_Free(dead_d);
    Py_DECREF(keys);
    Py_DECREF(cands);
    return result;
fail_dead:
    PyMem_Free(dead_e);
    PyMem_Free(dead_d);
fail:
    Py_DECREF(keys);
    Py_DECREF(cands);
    Py_DECREF(result);
    return NULL;
}

static size_t
BlockIndex_bytes(const BlockIndex *ix)
{
    size_t total = sizeof(BlockIndex) + ix->cap * sizeof(KeySlot) + ix->set_bytes +
                   ix->sets_cap * (sizeof(HolderSet *) + 2 * sizeof(uint32_t)) +
                   ix->icap * sizeof(uint32_t) + ix->scratch_cap * sizeof(uint32_t) +
                   ix->nengines * (TIERS * sizeof(OrdTable) + 4 * sizeof(uint32_t)) +
                   ix->exp_cap * sizeof(ExpSlot) + ix->heap_cap * sizeof(ExpRec);
    for (size_t k = 0; k < ix->nengines * TIERS; k++) {
        total += ord_bytes(&ix->held[k], 0);
    }
    return total;
}

/* stats() -> (distinct keys, firm records, holder sets, bytes) */
static PyObject *
BlockIndex_stats(BlockIndex *ix, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(nnnn)", (Py_ssize_t)ix->used, (Py_ssize_t)ix->entries,
                         (Py_ssize_t)ix->live_sets, (Py_ssize_t)BlockIndex_bytes(ix));
}

static PyObject *
BlockIndex_sizeof(BlockIndex *ix, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(BlockIndex_bytes(ix));
}

static int
BlockIndex_init(BlockIndex *ix, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_entries", "max_entries_per_engine", NULL};
    Py_ssize_t max_entries = 0, per_engine = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nn:BlockIndex", kwlist, &max_entries, &per_engine)) {
        return -1;
    }
    if (max_entries < 0 || per_engine < 0) {
        PyErr_SetString(PyExc_ValueError, "max_entries and max_entries_per_engine must be >= 0");
        return -1;
    }
    ix->max_entries = (size_t)max_entries;
    ix->max_per_engine = (size_t)per_engine;
    if (ix->sets == NULL) {
        size_t cap = 64;
        ix->sets = PyMem_Calloc(cap, sizeof(HolderSet *));
        ix->gens = PyMem_Calloc(cap, sizeof(uint32_t));
        ix->free_ids = PyMem_Calloc(cap, sizeof(uint32_t));
        if (ix->sets == NULL || ix->gens == NULL || ix->free_ids == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ix->sets_cap = cap;
        ix->nsets = 1; /* id 0: the empty set */
    }
    return 0;
}

static void
BlockIndex_dealloc(BlockIndex *ix)
{
    cc_flush(ix);
    PyMem_Free(ix->cc_obj);
    PyMem_Free(ix->cc_id);
    PyMem_Free(ix->table);
    for (size_t k = 0; k < ix->sets_cap; k++) {
        PyMem_Free(ix->sets ? ix->sets[k] : NULL);
    }
    PyMem_Free(ix->sets);
    PyMem_Free(ix->gens);
    PyMem_Free(ix->free_ids);
    PyMem_Free(ix->intern);
    PyMem_Free(ix->scratch);
    for (size_t k = 0; k < ix->nengines * TIERS; k++) {
        ord_free(&ix->held[k]);
    }
    PyMem_Free(ix->held);
    PyMem_Free(ix->tag);
    PyMem_Free(ix->alive);
    PyMem_Free(ix->off);
    PyMem_Free(ix->disk);
    PyMem_Free(ix->exp);
    PyMem_Free(ix->heap);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *
BlockIndex_evicted(BlockIndex *ix, void *Py_UNUSED(closure))
{
    return Py_BuildValue("(KK)", ix->evicted_engine_cap, ix->evicted_index_cap);
}

static PyObject *
BlockIndex_entries(BlockIndex *ix, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(ix->entries);
}

static PyObject *
BlockIndex_expiring(BlockIndex *ix, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(ix->exp_used);
}

static PyObject *
BlockIndex_next_deadline(BlockIndex *ix, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(ix->heap_n ? ix->heap[0].deadline : Py_HUGE_VAL);
}

static PyGetSetDef BlockIndex_getset[] = {
    {"expiring", (getter)BlockIndex_expiring, NULL, "expiring records held", NULL},
    {"next_deadline", (getter)BlockIndex_next_deadline, NULL,
     "the earliest deadline to sweep at (inf: none)", NULL},
    {"evicted", (getter)BlockIndex_evicted, NULL, "(engine_cap, index_cap) records evicted", NULL},
    {"entries", (getter)BlockIndex_entries, NULL, "firm records held", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef BlockIndex_methods[] = {
    {"add", (PyCFunction)BlockIndex_add, METH_VARARGS,
     "add(engine_id, tier, keys) -> firm records new to the index"},
    {"add_expiring", (PyCFunction)BlockIndex_add_expiring, METH_VARARGS,
     "add_expiring(engine_id, keys, deadline): GPU holder until deadline (firm ones aside)"},
    {"sweep", (PyCFunction)BlockIndex_sweep, METH_O,
     "sweep(now): drop the expiring records due at or before now"},
    {"remove", (PyCFunction)BlockIndex_remove, METH_VARARGS,
     "remove(engine_id, tier, keys) -> firm records removed (tier -1: every tier)"},
    {"clear", (PyCFunction)BlockIndex_clear, METH_VARARGS,
     "clear(engine_id) -> firm records removed"},
    {"held", (PyCFunction)BlockIndex_held, METH_VARARGS,
     "held(engine_id, tier) -> keys the engine holds firmly in tier"},
    {"held_keys", (PyCFunction)BlockIndex_held_keys, METH_VARARGS,
     "held_keys(engine_id, tier) -> those keys, oldest stored first"},
    {"held_union", (PyCFunction)BlockIndex_held_union, METH_VARARGS,
     "held_union(engine_id) -> distinct keys held firmly in any tier"},
    {"holders", (PyCFunction)BlockIndex_holders, METH_O,
     "holders(key) -> [(engine_id, code)] (code 0 GPU, 1 CPU, 2 disk, 3 expiring)"},
    {"lookup", (PyCFunction)BlockIndex_lookup, METH_VARARGS,
     "lookup(keys, candidates, ids, names, match[, generation]) -> {name: match(depth, "
     "offloaded, disk)}"},
    {"stats", (PyCFunction)BlockIndex_stats, METH_NOARGS,
     "stats() -> (distinct keys, firm records, holder sets, bytes)"},
    {"__sizeof__", (PyCFunction)BlockIndex_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._native.BlockIndex",
    .tp_basicsize = sizeof(BlockIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compact in-memory KV-block index (router/native/blocktable.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockIndex_init,
    .tp_dealloc = (destructor)BlockIndex_dealloc,
    .tp_methods = BlockIndex_methods,
    .tp_getset = BlockIndex_getset,
};

/* ------------------------------------------------------------------ BlockMap */

typedef struct {
    PyObject_HEAD
    OrdTable t;
} BlockMap;

static PyTypeObject BlockMapType;

static void
BlockMap_dealloc(BlockMap *m)
{
    ord_free(&m->t);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
BlockMap_len(BlockMap *m)
{
    return (Py_ssize_t)m->t.live;
}

static PyObject *
BlockMap_getitem(BlockMap *m, PyObject *obj)
{
    uint64_t key;
    if (!PyLong_Check(obj) || as_u64(obj, &key) != 0) {
        PyErr_Clear();
        PyErr_SetObject(PyExc_KeyError, obj);
        return NULL;
    }
    Py_ssize_t i = ord_find(&m->t, key);
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, obj);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(m->t.vals[m->t.slots[i] - 1]);
}

static int
BlockMap_setitem(BlockMap *m, PyObject *obj, PyObject *value)
{
    uint64_t key, val;
    if (value == NULL) {
        if (!PyLong_Check(obj) || as_u64(obj, &key) != 0) {
            PyErr_Clear();
            PyErr_SetObject(PyExc_KeyError, obj);
            return -1;
        }
        Py_ssize_t i = ord_find(&m->t, key);
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, obj);
            return -1;
        }
        ord_remove_slot(&m->t, i);
        return 0;
    }
    if (as_u64(obj, &key) != 0 || as_u64(value, &val) != 0) {
        return -1;
    }
    return ord_store(&m->t, key, val, 1, 0) < 0 ? -1 : 0;
}

static int
BlockMap_contains(BlockMap *m, PyObject *obj)
{
    uint64_t key;
    if (!PyLong_Check(obj) || as_u64(obj, &key) != 0) {
        PyErr_Clear();
        return 0;
    }
    return ord_find(&m->t, key) >= 0;
}

/* keys (0), values (1) or items (2), oldest first, as a list */
static PyObject *
BlockMap_list(BlockMap *m, int what)
{
    PyObject *out = PyList_New((Py_ssize_t)m->t.live);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t p = m->t.first; p < m->t.n; p++) {
        if (ord_is_dead(&m->t, p)) {
            continue;
        }
        PyObject *v;
        if (what == 0) {
            v = PyLong_FromUnsignedLongLong(m->t.keys[p]);
        } else if (what == 1) {
            v = PyLong_FromUnsignedLongLong(m->t.vals[p]);
        } else {
            v = Py_BuildValue("(KK)", (unsigned long long)m->t.keys[p], (unsigned long long)m->t.vals[p]);
        }
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, v);
    }
    return out;
}

static PyObject *
BlockMap_iter(BlockMap *m)
{
    PyObject *keys = BlockMap_list(m, 0);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
BlockMap_keys(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return BlockMap_list(m, 0);
}

static PyObject *
BlockMap_values(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return BlockMap_list(m, 1);
}

static PyObject *
BlockMap_items(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return BlockMap_list(m, 2);
}

static PyObject *
BlockMap_get(BlockMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    uint64_t key;
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    if (!PyLong_Check(args[0]) || as_u64(args[0], &key) != 0) {
        PyErr_Clear();
        Py_INCREF(fallback);
        return fallback;
    }
    Py_ssize_t i = ord_find(&m->t, key);
    if (i < 0) {
        Py_INCREF(fallback);
        return fallback;
    }
    return PyLong_FromUnsignedLongLong(m->t.vals[m->t.slots[i] - 1]);
}

static PyObject *
BlockMap_pop(BlockMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t key;
    Py_ssize_t i = -1;
    if (PyLong_Check(args[0]) && as_u64(args[0], &key) == 0) {
        i = ord_find(&m->t, key);
    } else {
        PyErr_Clear();
    }
    if (i < 0) {
        if (nargs == 2) {
            Py_INCREF(args[1]);
            return args[1];
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    uint64_t val = m->t.vals[m->t.slots[i] - 1];
    ord_remove_slot(&m->t, i);
    return PyLong_FromUnsignedLongLong(val);
}

static PyObject *
BlockMap_clear(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    ord_free(&m->t);
    Py_RETURN_NONE;
}

/* store(hashes, keys, reorder): each hash -> key, as router.index.base.store_newest
 * stores into a dict: new hashes at the end; held ones keep their place, or with
 * ``reorder`` move to the end (all popped first, so a hash given twice sits where it
 * first appears, with its last value); as many pairs as the shorter sequence has */
static PyObject *
BlockMap_store(BlockMap *m, PyObject *args)
{
    PyObject *hs, *ks;
    int reorder;
    if (!PyArg_ParseTuple(args, "OOp:store", &hs, &ks, &reorder)) {
        return NULL;
    }
    uint64_t *hashes, *keys;
    Py_ssize_t nh = u64_array(hs, &hashes);
    if (nh < 0) {
        return NULL;
    }
    Py_ssize_t nk = u64_array(ks, &keys);
    if (nk < 0) {
        PyMem_Free(hashes);
        return NULL;
    }
    Py_ssize_t n = nh < nk ? nh : nk;
    if (reorder) { /* as dict: pop them all, then store (first place, last value) */
        for (Py_ssize_t k = 0; k < n && m->t.live; k++) {
            Py_ssize_t i = ord_find(&m->t, hashes[k]);
            if (i >= 0) {
                ord_remove_slot(&m->t, i);
            }
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ord_store(&m->t, hashes[k], keys[k], 1, 0) < 0) {
            PyMem_Free(hashes);
            PyMem_Free(keys);
            return NULL;
        }
    }
    PyMem_Free(hashes);
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

/* pop_oldest(count) -> the values of the ``count`` oldest entries, which are removed */
static PyObject *
BlockMap_pop_oldest(BlockMap *m, PyObject *arg)
{
    Py_ssize_t count = PyLong_AsSsize_t(arg);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (count < 0) {
        count = 0;
    }
    if ((size_t)count > m->t.live) {
        count = (Py_ssize_t)m->t.live;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        size_t p = ord_next_live(&m->t, m->t.first);
        m->t.first = p;
        PyObject *v = PyLong_FromUnsignedLongLong(m->t.vals[p]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
        ord_remove_slot(&m->t, ord_find(&m->t, m->t.keys[p]));
    }
    return out;
}

static PyObject *
BlockMap_update(BlockMap *m, PyObject *other)
{
    PyObject *items;
    if (PyDict_Check(other)) {
        items = PyDict_Items(other);
    } else if (Py_IS_TYPE(other, &BlockMapType)) {
        items = BlockMap_list((BlockMap *)other, 2);
    } else if (PyObject_HasAttrString(other, "items")) {
        PyObject *view = PyObject_CallMethod(other, "items", NULL);
        items = view ? PySequence_List(view) : NULL;
        Py_XDECREF(view);
    } else {
        items = PySequence_List(other);
    }
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(items, k);
        PyObject *fast = PySequence_Fast(pair, "update() takes pairs");
        if (fast == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        if (PySequence_Fast_GET_SIZE(fast) != 2 ||
            BlockMap_setitem(m, PySequence_Fast_GET_ITEM(fast, 0), PySequence_Fast_GET_ITEM(fast, 1)) != 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "update() takes pairs");
            }
            Py_DECREF(fast);
            Py_DECREF(items);
            return NULL;
        }
        Py_DECREF(fast);
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

static PyObject *
BlockMap_sizeof(BlockMap *m, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(BlockMap) + ord_bytes(&m->t, 1));
}

/* a BlockMap's entries as a dict (comparisons) */
static PyObject *
BlockMap_dict(BlockMap *m)
{
    PyObject *items = BlockMap_list(m, 2);
    if (items == NULL) {
        return NULL;
    }
    PyObject *out = PyDict_New();
    for (Py_ssize_t k = 0; out != NULL && k < PyList_GET_SIZE(items); k++) {
        PyObject *pair = PyList_GET_ITEM(items, k);
        if (PyDict_SetItem(out, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) != 0) {
            Py_CLEAR(out);
        }
    }
    Py_DECREF(items);
    return out;
}

/* == and != against a dict or another BlockMap: the same pairs (order aside, as dicts) */
static PyObject *
BlockMap_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(a, &BlockMapType) ||
        !(PyDict_Check(b) || Py_IS_TYPE(b, &BlockMapType))) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *mine = BlockMap_dict((BlockMap *)a);
    if (mine == NULL) {
        return NULL;
    }
    PyObject *theirs = PyDict_Check(b) ? Py_NewRef(b) : BlockMap_dict((BlockMap *)b);
    if (theirs == NULL) {
        Py_DECREF(mine);
        return NULL;
    }
    PyObject *result = PyObject_RichCompare(mine, theirs, op);
    Py_DECREF(mine);
    Py_DECREF(theirs);
    return result;
}

static PyMappingMethods BlockMap_mapping = {
    .mp_length = (lenfunc)BlockMap_len,
    .mp_subscript = (binaryfunc)BlockMap_getitem,
    .mp_ass_subscript = (objobjargproc)BlockMap_setitem,
};

static PySequenceMethods BlockMap_sequence = {
    .sq_contains = (objobjproc)BlockMap_contains,
};

static PyMethodDef BlockMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))BlockMap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)BlockMap_clear, METH_NOARGS, "remove every entry"},
    {"keys", (PyCFunction)BlockMap_keys, METH_NOARGS, "the keys, oldest first (a list)"},
    {"values", (PyCFunction)BlockMap_values, METH_NOARGS, "the values, oldest first (a list)"},
    {"items", (PyCFunction)BlockMap_items, METH_NOARGS, "(key, value) pairs, oldest first (a list)"},
    {"update", (PyCFunction)BlockMap_update, METH_O, "update(mapping or pairs)"},
    {"store", (PyCFunction)BlockMap_store, METH_VARARGS,
     "store(hashes, keys, reorder): each pair as the newest (reorder) or in place"},
    {"pop_oldest", (PyCFunction)BlockMap_pop_oldest, METH_O,
     "pop_oldest(count) -> the values of the oldest entries, removed"},
    {"__sizeof__", (PyCFunction)BlockMap_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._native.BlockMap",
    .tp_basicsize = sizeof(BlockMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An insertion-ordered map of uint64 to uint64 (router/native/blocktable.c).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)BlockMap_dealloc,
    .tp_as_mapping = &BlockMap_mapping,
    .tp_as_sequence = &BlockMap_sequence,
    .tp_iter = (getiterfunc)BlockMap_iter,
    .tp_richcompare = BlockMap_richcompare,
    .tp_methods = BlockMap_methods,
};

int
kvroute_add_block_types(PyObject *module)
{
    if (PyType_Ready(&BlockIndexType) < 0 || PyType_Ready(&BlockMapType) < 0) {
        return -1;
    }
    Py_INCREF(&BlockIndexType);
    if (PyModule_AddObject(module, "BlockIndex", (PyObject *)&BlockIndexType) < 0) {
        Py_DECREF(&BlockIndexType);
        return -1;
    }
    Py_INCREF(&BlockMapType);
    if (PyModule_AddObject(module, "BlockMap", (PyObject *)&BlockMapType) < 0) {
        Py_DECREF(&BlockMapType);
        return -1;
    }
    return 0;
}
