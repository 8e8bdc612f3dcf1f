/* router._native.latency_scan: the C twin of router/policy/latency.py's
 * LatencyPolicy.score (and its _speeds) over every candidate, without a Score object per
 * candidate (the policy makes those only when a caller reads them). The same float
 * operations in the same order, so totals, and therefore ties and choices, are
 * bit-identical to the pure path's (setup.py compiles with -ffp-contract=off: no fused
 * multiply-adds; pow() is the libm call CPython's float ** makes); tests hold the two
 * equal.
 *
 * latency_scan(candidates, matches, loads, transfers, pinned, params)
 *     -> (tied, deepest, unbonused_best, columns)
 *
 * ``matches`` and ``loads`` are dicts keyed by the candidates (absent: no match, no
 * load); ``transfers`` a dict of candidate -> transfer tokens, or None; ``pinned`` the
 * engine the request's session was served by last, or None. ``params`` is (block_size,
 * prompt_tokens, cap, offload_discount, disk_extra, waiting_weight, running_weight,
 * kv_usage_weight, fresh_after or None, now, queue_weight, tie_tolerance, busiest,
 * idle_prefill_weight or None, itl_weight, by_decoding, slowdown_weight, max_tokens, backlog,
 * transfer_s_per_token or None, bonus_max, wait_cap, speed_tolerance, offered_half_life,
 * ln2, tie, (prior a, b, tpot_base, tpot_per_seq)). ``tied`` lists the positions whose
 * total is within max(tie, tie_tolerance * |lowest|) of the lowest, ``deepest`` is the largest match depth,
 * ``unbonused_best`` the lowest total before session bonuses, and ``columns`` is bytes of
 * 12 doubles per candidate: matched blocks, cached tokens, queue, prefill, decode,
 * reported, total, transfer, ttft, harm, tpot, bonus.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define COLUMNS 12

static PyObject *s_blocks, *s_offloaded, *s_disk, *s_prefill_tokens, *s_requests, *s_decoding,
    *s_reported_at, *s_waiting, *s_running, *s_kv_usage, *s_latency, *s_offered, *s_offered_at,
    *s_replicas, *s_backlog_until, *s_peer_prefill_tokens, *s_prefill_s_per_token,
    *s_ttft_overhead_s, *s_tpot_base_s, *s_tpot_s_per_seq, *s_output_tokens;

/* an int attribute of ``obj`` as a long long; -1 with an exception set on error */
static int
get_ll(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* a number attribute as a double; None as 0.0 with *present 0 (present may be NULL) */
static int
get_num(PyObject *obj, PyObject *name, double *out, int *present)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    if (present) {
        *present = v != Py_None;
    }
    if (v == Py_None) {
        *out = 0.0;
        Py_DECREF(v);
        return 0;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* a double from a Python number, or ``none`` when it is None (*present 0) */
static int
opt_double(PyObject *obj, double *out, int *present)
{
    *present = obj != Py_None;
    if (obj == Py_None) {
        *out = 0.0;
        return 0;
    }
    *out = PyFloat_AsDouble(obj);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* statistics.median_low: element (n - 1) // 2 of the values in order, found by
 * quickselect on a copy (the values are finite: fitted coefficients and priors) */
static double
median_low(const double *values, Py_ssize_t n, double *scratch)
{
    memcpy(scratch, values, (size_t)n * sizeof(double));
    Py_ssize_t k = (n - 1) / 2, lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = scratch[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (scratch[i] < pivot) {
                i++;
            }
            while (scratch[j] > pivot) {
                j--;
            }
            if (i <= j) {
                double t = scratch[i];
                scratch[i] = scratch[j];
                scratch[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j) {
            hi = j;
        } else if (k >= i) {
            lo = i;
        } else {
            return scratch[k];
        }
    }
    return scratch[k];
}

/* latency.py's _near: ``mid`` when ``value`` is within [low, high] times it */
static double
near(double value, double mid, double low, double high)
{
    if (mid > 0) {
        double ratio = value / mid;
        if (low <= ratio && ratio <= high) {
            return mid;
        }
    }
    return value;
}

/* latency.py's _busy */
static double
busy_of(double utilization, double most)
{
    if (utilization <= 0.0) {
        return 0.0;
    }
    if (utilization >= 1.0) {
        return most;
    }
    double busy = utilization / (1.0 - utilization);
    return busy < most ? busy : most;
}

static PyObject *
latency_scan(PyObject *module, PyObject *args)
{
    PyObject *cands_obj, *matches, *loads, *transfers, *pinned;
    long long bs, isl, cap, by_decoding, backlog;
    double offload_discount, disk_extra, ww, wr, wk, now, qw, tie_tolerance, busiest, itl_w, slowdown,
        out,
        bonus_max, wait_cap, tol, half_life, ln2, tie, pa, pb, ptb, pts;
    PyObject *fresh_obj, *idle_obj, *per_moved_obj;
    if (!PyArg_ParseTuple(args,
                          "OO!O!OO(LLLdddddOddddOdLddLOdddddd(dddd)):latency_scan", &cands_obj,
                          &PyDict_Type, &matches, &PyDict_Type, &loads, &transfers, &pinned, &bs,
                          &isl, &cap, &offload_discount, &disk_extra, &ww, &wr, &wk, &fresh_obj,
                          &now, &qw, &tie_tolerance, &busiest, &idle_obj, &itl_w, &by_decoding, &slowdown, &out,
                          &backlog, &per_moved_obj, &bonus_max, &wait_cap, &tol, &half_life,
                          &ln2, &tie, &pa, &pb, &ptb, &pts)) {
        return NULL;
    }
    if (transfers != Py_None && !PyDict_Check(transfers)) {
        PyErr_SetString(PyExc_TypeError, "transfers must be a dict or None");
        return NULL;
    }
    double fresh_after, idle, per_moved;
    int reports, has_idle, has_per_moved;
    if (opt_double(fresh_obj, &fresh_after, &reports) != 0 ||
        opt_double(idle_obj, &idle, &has_idle) != 0 ||
        opt_double(per_moved_obj, &per_moved, &has_per_moved) != 0) {
        return NULL;
    }
    const int transferring = transfers != Py_None && PyDict_GET_SIZE(transfers) > 0;
    PyObject *cands = PySequence_Fast(cands_obj, "candidates must be a sequence");
    if (cands == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cands);
    PyObject **items = PySequence_Fast_ITEMS(cands);
    Py_ssize_t rows = n ? n : 1;
    PyObject *columns = PyBytes_FromStringAndSize(NULL, rows * COLUMNS * (Py_ssize_t)sizeof(double));
    /* speeds: a, b, tpot_base, tpot_per_seq per candidate, then one scratch column */
    double *speed = PyMem_Malloc((size_t)rows * 5 * sizeof(double));
    if (columns == NULL || speed == NULL) {
        Py_XDECREF(columns);
        PyMem_Free(speed);
        Py_DECREF(cands);
        return columns == NULL ? NULL : PyErr_NoMemory();
    }
    double *sa = speed, *sb = speed + rows, *stb = speed + 2 * rows, *sts = speed + 3 * rows,
           *scratch = speed + 4 * rows;
    /* pass 1: each candidate's speeds (its fitted lines, else the priors) */
    int timed_any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        sa[i] = pa;
        sb[i] = pb;
        stb[i] = ptb;
        sts[i] = pts;
        PyObject *load = PyDict_GetItemWithError(loads, items[i]);
        if (load == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            continue;
        }
        PyObject *fit = PyObject_GetAttr(load, s_latency);
        if (fit == NULL) {
            goto fail;
        }
        if (fit != Py_None) {
            timed_any = 1;
            if (get_num(fit, s_prefill_s_per_token, &sa[i], NULL) != 0 ||
                get_num(fit, s_ttft_overhead_s, &sb[i], NULL) != 0 ||
                get_num(fit, s_tpot_base_s, &stb[i], NULL) != 0 ||
                get_num(fit, s_tpot_s_per_seq, &sts[i], NULL) != 0) {
                Py_DECREF(fit);
                goto fail;
            }
        }
        Py_DECREF(fit);
    }
    if (n >= 2 && timed_any) { /* all priors: each median is the prior, nothing moves */
        double ma = median_low(sa, n, scratch), mb = median_low(sb, n, scratch),
               mtb = median_low(stb, n, scratch), mts = median_low(sts, n, scratch);
        double low = 1.0 / (1.0 + tol), high = 1.0 + tol;
        for (Py_ssize_t i = 0; i < n; i++) {
            sa[i] = near(sa[i], ma, low, high);
            sb[i] = mb;
            stb[i] = near(stb[i], mtb, low, high);
            sts[i] = near(sts[i], mts, low, high);
        }
    }
    /* pass 2: the cost terms */
    double *col = (double *)PyBytes_AS_STRING(columns);
    double best = Py_HUGE_VAL, unbonused = Py_HUGE_VAL;
    long long deepest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *engine = items[i];
        double a = sa[i], b = sb[i];
        long long blocks = 0, cached = 0;
        PyObject *match = PyDict_GetItemWithError(matches, engine);
        if (match == NULL && PyErr_Occurred()) {
            goto fail;
        }
        if (match != NULL) {
            long long offloaded, disk;
            if (get_ll(match, s_blocks, &blocks) != 0 || get_ll(match, s_offloaded, &offloaded) != 0) {
                goto fail;
            }
            double held = (double)blocks;
            if (offloaded) {
                held -= (double)offloaded * offload_discount;
                if (get_ll(match, s_disk, &disk) != 0) {
                    goto fail;
                }
                if (disk) {
                    held -= (double)disk * disk_extra;
                }
            }
            cached = (long long)(held * (double)bs + 1e-6); /* int() truncates alike */
            if (cached > cap) {
                cached = cap;
            }
        }
        double uncached = (double)(isl - cached);
        double moved = 0.0;
        if (transferring) {
            PyObject *t = PyDict_GetItemWithError(transfers, engine);
            if (t == NULL && PyErr_Occurred()) {
                goto fail;
            }
            if (t != NULL) {
                moved = PyFloat_AsDouble(t);
                if (moved == -1.0 && PyErr_Occurred()) {
                    goto fail;
                }
            }
        }
        long long queued = 0, decoding = 0, requests = 0;
        double reported = 0.0, busy = 0.0, wait;
        double expected = out; /* no answer counted there: max_tokens */
        int timed = 0;
        double backlog_until = 0.0, peer_prefill = 0.0;
        PyObject *load = PyDict_GetItemWithError(loads, engine);
        if (load == NULL && PyErr_Occurred()) {
            goto fail;
        }
        if (load != NULL) {
            double offered, offered_at, outputs;
            long long replicas;
            if (get_ll(load, s_prefill_tokens, &queued) != 0 || get_ll(load, s_decoding, &decoding) != 0 ||
                get_ll(load, s_requests, &requests) != 0 || get_num(load, s_offered, &offered, NULL) != 0 ||
                get_num(load, s_offered_at, &offered_at, NULL) != 0 ||
                get_ll(load, s_replicas, &replicas) != 0 ||
                get_num(load, s_output_tokens, &outputs, NULL) != 0) {
                goto fail;
            }
            expected = outputs < out ? outputs : out; /* min(out, load.output_tokens) */
            if (reports) {
                double at;
                int present;
                if (get_num(load, s_reported_at, &at, &present) != 0) {
                    goto fail;
                }
                if (present && at >= fresh_after) {
                    double waiting, running, usage;
                    if (get_num(load, s_waiting, &waiting, NULL) != 0 ||
                        get_num(load, s_running, &running, NULL) != 0 ||
                        get_num(load, s_kv_usage, &usage, NULL) != 0) {
                        goto fail;
                    }
                    reported = ww * waiting + wr * running + wk * usage;
                }
            }
            reported = reported * a * (double)bs;
            /* EngineLoad.offered_tokens_per_s */
            double rate = 0.0;
            if (offered != 0.0) {
                double age = now - offered_at;
                double kept = age > 0 ? offered * pow(0.5, age / half_life) : offered;
                rate = kept * (double)replicas * ln2 / half_life;
            }
            busy = busy_of(a * rate, busiest);
            if (backlog) {
                PyObject *fit = PyObject_GetAttr(load, s_latency);
                if (fit == NULL) {
                    goto fail;
                }
                timed = fit != Py_None;
                Py_DECREF(fit);
                if (timed && (get_num(load, s_backlog_until, &backlog_until, NULL) != 0 ||
                              get_num(load, s_peer_prefill_tokens, &peer_prefill, NULL) != 0)) {
                    goto fail;
                }
            }
        }
        if (timed) {
            double left = backlog_until - now; /* max(left, 0.0) as Python's max() */
            wait = (0.0 > left ? 0.0 : left) + a * peer_prefill;
        } else {
            wait = a * (double)queued;
        }
        double queue = qw * wait;
        double prefill = (has_idle && !requests) ? idle * a * uncached : (1.0 + busy) * a * uncached;
        double transfer = has_per_moved ? moved * per_moved : a * moved;
        double harm = itl_w * a * uncached * (double)(by_decoding ? decoding : requests);
        double decode = slowdown * expected * sts[i] * (double)decoding;
        double ttft = b + wait + a * uncached + transfer;
        double bonus = 0.0;
        if (pinned != Py_None && wait_cap > 0) {
            int same = PyObject_RichCompareBool(engine, pinned, Py_EQ);
            if (same < 0) {
                goto fail;
            }
            if (same) {
                bonus = bonus_max * (1.0 - wait / wait_cap);
                if (!(bonus > 0.0)) {
                    bonus = 0.0;
                }
            }
        }
        double total = b + queue + prefill + transfer + decode + reported + harm - bonus;
        double *row = col + i * COLUMNS;
        row[0] = (double)blocks;
        row[1] = (double)cached;
        row[2] = queue;
        row[3] = prefill;
        row[4] = decode;
        row[5] = reported;
        row[6] = total;
        row[7] = transfer;
        row[8] = ttft;
        row[9] = harm;
        row[10] = stb[i] + sts[i] * (double)(decoding + 1);
        row[11] = bonus;
        if (total < best) {
            best = total;
        }
        if (total + bonus < unbonused) {
            unbonused = total + bonus;
        }
        if (blocks > deepest) {
            deepest = blocks;
        }
    }
    PyMem_Free(speed);
    speed = NULL;
    PyObject *tied = PyList_New(0);
    if (tied == NULL) {
        goto fail;
    }
    double tolerance = tie_tolerance * fabs(best); /* max(tie, ...) as Python's max() */
    if (!(tolerance > tie)) {
        tolerance = tie;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (col[i * COLUMNS + 6] - best <= tolerance) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(tied, at) != 0) {
                Py_XDECREF(at);
                Py_DECREF(tied);
                goto fail;
            }
            Py_DECREF(at);
        }
    }
    Py_DECREF(cands);
    return Py_BuildValue("(NLdN)", tied, deepest, unbonused, columns);
fail:
    PyMem_Free(speed);
    Py_DECREF(columns);
    Py_DECREF(cands);
    return NULL;
}

static PyMethodDef latency_methods[] = {
    {"latency_scan", latency_scan, METH_VARARGS,
     "latency_scan(candidates, matches, loads, transfers, pinned, params) -> (tied, deepest, "
     "unbonused_best, columns)"},
    {NULL, NULL, 0, NULL},
};

int
kvroute_add_latency_functions(PyObject *module)
{
    PyObject **names[] = {&s_blocks,          &s_offloaded,     &s_disk,
                          &s_prefill_tokens,  &s_requests,      &s_decoding,
                          &s_reported_at,     &s_waiting,       &s_running,
                          &s_kv_usage,        &s_latency,       &s_offered,
                          &s_offered_at,      &s_replicas,      &s_backlog_until,
                          &s_peer_prefill_tokens, &s_prefill_s_per_token, &s_ttft_overhead_s,
                          &s_tpot_base_s,     &s_tpot_s_per_seq, &s_output_tokens};
    const char *text[] = {"blocks",          "offloaded",     "disk",
                          "prefill_tokens",  "requests",      "decoding",
                          "reported_at",     "waiting",       "running",
                          "kv_usage",        "latency",       "offered",
                          "offered_at",      "replicas",      "backlog_until",
                          "peer_prefill_tokens", "prefill_s_per_token", "ttft_overhead_s",
                          "tpot_base_s",     "tpot_s_per_seq", "output_tokens"};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        *names[k] = PyUnicode_InternFromString(text[k]);
        if (*names[k] == NULL) {
            return -1;
        }
    }
    return PyModule_AddFunctions(module, latency_methods);
}
