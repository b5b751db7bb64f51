/* Depth-first search over ideals under a peak cap, compiled.
 *
 * This follows memplan.schedule.ideals._Search step for step: same options in the same order,
 * same dominance rule and look-ahead, same dead ideals (up to the same limit), same node count.
 * The Python side flattens the graph (IdealGraph) into compressed-row arrays.
 *
 * Returns 1 (found: order_out holds the searched steps), 0 (proven: nothing fits the cap) or
 * -1 (node limit or deadline reached). stats_out[0] = nodes, stats_out[1] = 1 if memory ran out.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int64_t i64;
typedef uint64_t u64;

#define FOUND 1
#define NOT_FOUND 0
#define ABORTED (-1)

typedef struct { i64 *data; i64 len, cap; } Vec;

typedef struct {
    /* the graph */
    i64 n;
    const i64 *succ_ptr, *succ, *num_preds, *alloc, *unread, *reads_ptr, *reads, *tensor_bytes, *num_readers;
    i64 cap, goal, max_nodes, max_dead;
    double deadline;
    /* state */
    i64 *preds_left, *readers_left;
    i64 *ready, *ready_pos, num_ready;  /* ready ops, unordered, with positions */
    i64 mem;
    u64 *done;
    i64 words;
    i64 *order, order_len;
    /* dead ideals: open addressing over a pool of bitsets */
    u64 *pool;
    i64 *table, table_size, num_dead;
    /* scratch */
    Vec newly, trail;
    i64 *mark, stamp;        /* per op, for the look-ahead's "newly" set */
    i64 nodes;
    int oom;
} Search;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static i64 freed(const Search *S, i64 v) {
    i64 f = S->unread[v];
    for (i64 k = S->reads_ptr[v]; k < S->reads_ptr[v + 1]; ++k) {
        i64 e = S->reads[k];
        if (S->readers_left[e] == 1) f += S->tensor_bytes[e];
    }
    return f;
}

static void ready_add(Search *S, i64 v) {
    S->ready_pos[v] = S->num_ready;
    S->ready[S->num_ready++] = v;
}

static void ready_remove(Search *S, i64 v) {
    i64 p = S->ready_pos[v], last = S->ready[--S->num_ready];
    S->ready[p] = last;
    S->ready_pos[last] = p;
    S->ready_pos[v] = -1;
}

static i64 run(Search *S, i64 v) {
    i64 delta = S->alloc[v] - freed(S, v);
    S->mem += delta;
    S->done[v >> 6] |= (u64)1 << (v & 63);
    S->order[S->order_len++] = v;
    ready_remove(S, v);
    for (i64 k = S->reads_ptr[v]; k < S->reads_ptr[v + 1]; ++k) S->readers_left[S->reads[k]] -= 1;
    for (i64 k = S->succ_ptr[v]; k < S->succ_ptr[v + 1]; ++k) {
        i64 s = S->succ[k];
        if (--S->preds_left[s] == 0) ready_add(S, s);
    }
    return delta;
}

static void undo(Search *S, i64 v, i64 delta) {
    for (i64 k = S->succ_ptr[v + 1] - 1; k >= S->succ_ptr[v]; --k) {
        i64 s = S->succ[k];
        if (S->preds_left[s] == 0) ready_remove(S, s);
        S->preds_left[s] += 1;
    }
    for (i64 k = S->reads_ptr[v]; k < S->reads_ptr[v + 1]; ++k) S->readers_left[S->reads[k]] += 1;
    ready_add(S, v);
    S->order_len -= 1;
    S->done[v >> 6] &= ~((u64)1 << (v & 63));
    S->mem -= delta;
}

/* ---------------------------------------------------------------- dead ideals */

static u64 hash_done(const Search *S) {
    u64 h = 1469598103934665603ULL;
    for (i64 w = 0; w < S->words; ++w) {
        h ^= S->done[w];
        h *= 1099511628211ULL;
        h ^= h >> 29;
    }
    return h;
}

static int is_dead(const Search *S) {
    if (!S->table_size) return 0;
    i64 mask = S->table_size - 1, i = (i64)(hash_done(S) & (u64)mask);
    while (S->table[i] >= 0) {
        if (memcmp(S->pool + S->table[i] * S->words, S->done, (size_t)S->words * sizeof(u64)) == 0) return 1;
        i = (i + 1) & mask;
    }
    return 0;
}

/* Remember the current ideal as dead (up to max_dead of them); the table doubles as it fills. */
static void add_dead(Search *S) {
    if (S->num_dead >= S->max_dead) return;
    if (2 * (S->num_dead + 1) > S->table_size) {
        i64 size = S->table_size ? 2 * S->table_size : 1024;
        i64 *table = malloc((size_t)size * sizeof(i64));
        u64 *pool = realloc(S->pool, (size_t)(size / 2) * (size_t)S->words * sizeof(u64));
        if (!table || !pool) { free(table); if (pool) S->pool = pool; S->max_dead = S->num_dead; return; }
        S->pool = pool;
        for (i64 i = 0; i < size; ++i) table[i] = -1;
        u64 *saved = S->done;
        for (i64 k = 0; k < S->num_dead; ++k) {  /* rehash every stored ideal */
            S->done = S->pool + k * S->words;
            i64 i = (i64)(hash_done(S) & (u64)(size - 1));
            while (table[i] >= 0) i = (i + 1) & (size - 1);
            table[i] = k;
        }
        S->done = saved;
        free(S->table);
        S->table = table;
        S->table_size = size;
    }
    i64 mask = S->table_size - 1, i = (i64)(hash_done(S) & (u64)mask);
    while (S->table[i] >= 0) i = (i + 1) & mask;
    memcpy(S->pool + S->num_dead * S->words, S->done, (size_t)S->words * sizeof(u64));
    S->table[i] = S->num_dead++;
}

/* ---------------------------------------------------------------- one node */

static int vpush(Search *S, Vec *v, i64 x) {
    if (v->len == v->cap) {
        i64 cap = v->cap ? 2 * v->cap : 1024;
        i64 *d = realloc(v->data, (size_t)cap * sizeof(i64));
        if (!d) { S->oom = 1; return 0; }
        v->data = d;
        v->cap = cap;
    }
    v->data[v->len++] = x;
    return 1;
}

static void add_successors(Search *S, i64 v) {
    for (i64 k = S->succ_ptr[v]; k < S->succ_ptr[v + 1]; ++k) {
        i64 s = S->succ[k];
        if (S->mark[s] != S->stamp) {
            S->mark[s] = S->stamp;
            vpush(S, &S->newly, s);
        }
    }
}

/* Where running v leads (see ideals._Search.look_ahead): run v, then the ops it makes ready
 * that the dominance rule would run (lowest number first, again and again), measure, undo. */
static i64 look_ahead(Search *S, i64 v) {
    i64 before = S->mem;
    S->trail.len = 0;
    S->newly.len = 0;
    S->stamp += 1;
    i64 d0 = run(S, v);
    vpush(S, &S->trail, v);
    vpush(S, &S->trail, d0);
    add_successors(S, v);
    while (!S->oom) {
        i64 pick = -1, at = -1;
        for (i64 i = 0; i < S->newly.len; ++i) {
            i64 s = S->newly.data[i];
            if (s < 0 || S->ready_pos[s] < 0) continue;
            if (S->mem + S->alloc[s] > S->cap || S->alloc[s] - freed(S, s) > 0) continue;
            if (pick < 0 || s < pick) { pick = s; at = i; }
        }
        if (pick < 0) break;
        S->newly.data[at] = -1;
        i64 delta = run(S, pick);
        vpush(S, &S->trail, pick);
        vpush(S, &S->trail, delta);
        add_successors(S, pick);
    }
    i64 relief = 0;
    for (i64 i = 0; i < S->newly.len; ++i) {
        i64 s = S->newly.data[i];
        if (s < 0 || S->ready_pos[s] < 0) continue;
        i64 f = freed(S, s);
        if (f > relief) relief = f;
    }
    i64 added = S->mem - before;
    for (i64 i = S->trail.len - 2; i >= 0; i -= 2) undo(S, S->trail.data[i], S->trail.data[i + 1]);
    return added - relief;
}

typedef struct { i64 score, delta, v; } Option;

static int by_option(const void *a, const void *b) {
    const Option *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? -1 : 1;
    if (x->delta != y->delta) return x->delta < y->delta ? -1 : 1;
    return x->v < y->v ? -1 : (x->v > y->v);
}

static int complete(Search *S) {
    if (S->order_len == S->goal) return FOUND;
    if (is_dead(S)) return NOT_FOUND;
    S->nodes += 1;
    if (S->nodes > S->max_nodes || S->oom) return ABORTED;
    if ((S->nodes & 63) == 0 && now_seconds() > S->deadline) return ABORTED;
    i64 count = 0, dominant = -1;
    Option *options = malloc((size_t)(S->num_ready ? S->num_ready : 1) * sizeof(Option));
    if (!options) { S->oom = 1; return ABORTED; }
    for (i64 i = 0; i < S->num_ready; ++i) {
        i64 v = S->ready[i];
        if (S->mem + S->alloc[v] > S->cap) continue;
        i64 delta = S->alloc[v] - freed(S, v);
        if (delta <= 0 && (dominant < 0 || v < dominant)) dominant = v;
        options[count].delta = delta;
        options[count].v = v;
        options[count].score = 0;
        ++count;
    }
    if (dominant >= 0) {
        options[0].v = dominant;
        count = 1;
    } else {
        for (i64 i = 0; i < count; ++i) options[i].score = look_ahead(S, options[i].v);
        qsort(options, (size_t)count, sizeof(Option), by_option);
    }
    int result = NOT_FOUND;
    for (i64 i = 0; i < count; ++i) {
        i64 v = options[i].v;
        i64 delta = run(S, v);
        result = complete(S);
        if (result != NOT_FOUND) break;
        undo(S, v, delta);
    }
    free(options);
    if (result == NOT_FOUND) add_dead(S);
    return result;
}

int is_search(i64 n, const i64 *succ_ptr, const i64 *succ, const i64 *num_preds, const i64 *alloc,
              const i64 *unread, const i64 *reads_ptr, const i64 *reads, i64 num_tensors, const i64 *tensor_bytes,
              const i64 *num_readers, i64 base, i64 cap, i64 prefix_len, const i64 *prefix, i64 goal, i64 max_nodes,
              i64 max_dead, double seconds_left, i64 *order_out, i64 *stats_out) {
    Search S;
    memset(&S, 0, sizeof S);
    S.n = n;
    S.succ_ptr = succ_ptr; S.succ = succ; S.num_preds = num_preds; S.alloc = alloc; S.unread = unread;
    S.reads_ptr = reads_ptr; S.reads = reads; S.tensor_bytes = tensor_bytes; S.num_readers = num_readers;
    S.cap = cap; S.goal = goal; S.max_nodes = max_nodes; S.max_dead = max_dead;
    S.deadline = now_seconds() + seconds_left;
    S.words = (n + 63) / 64;
    size_t nn = (size_t)(n ? n : 1), nt = (size_t)(num_tensors ? num_tensors : 1);
    S.preds_left = malloc(nn * sizeof(i64)); S.readers_left = malloc(nt * sizeof(i64));
    S.ready = malloc(nn * sizeof(i64)); S.ready_pos = malloc(nn * sizeof(i64));
    S.done = calloc((size_t)(S.words ? S.words : 1), sizeof(u64));
    S.order = malloc(nn * sizeof(i64));
    S.mark = calloc(nn, sizeof(i64));
    int result = ABORTED;
    if (S.preds_left && S.readers_left && S.ready && S.ready_pos && S.done && S.order && S.mark) {
        for (i64 v = 0; v < n; ++v) { S.preds_left[v] = num_preds[v]; S.ready_pos[v] = -1; }
        for (i64 e = 0; e < num_tensors; ++e) S.readers_left[e] = num_readers[e];
        for (i64 v = 0; v < n; ++v) if (num_preds[v] == 0) ready_add(&S, v);
        S.mem = base;
        for (i64 i = 0; i < prefix_len; ++i) run(&S, prefix[i]);
        result = complete(&S);
        if (result == FOUND)
            for (i64 i = prefix_len; i < goal; ++i) order_out[i - prefix_len] = S.order[i];
    }
    stats_out[0] = S.nodes;
    stats_out[1] = S.oom;
    free(S.preds_left); free(S.readers_left); free(S.ready); free(S.ready_pos); free(S.done); free(S.order);
    free(S.mark); free(S.table); free(S.pool); free(S.newly.data); free(S.trail.data);
    return result;
}
