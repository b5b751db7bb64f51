/* MiniMalloc's canonical depth-first search (Moffitt, ASPLOS 2023), compiled.
 *
 * This follows memplan.placement.search.ReferenceSearch step for step: same candidates in the
 * same order, same pruning, same node count. The Python side computes the sweep (sections,
 * partitions, overlaps) and passes it in compressed-row arrays; everything is in units.
 *
 * Returns 1 (found: solution_out holds offsets), 0 (proven: nothing fits) or -1 (node limit
 * or deadline reached, or *cancel set). stats_out[0] = nodes, stats_out[1] = backtracks, stats_out[2] = 1
 * when memory ran out.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int64_t i64;

enum {
    CANONICAL_ONLY = 1 << 0,
    SECTION_INFERENCE = 1 << 1,
    DYNAMIC_ORDERING = 1 << 2,
    CHECK_DOMINANCE = 1 << 3,
    UNALLOCATED_FLOOR = 1 << 4,
    STATIC_PREORDERING = 1 << 5,
    DYNAMIC_DECOMPOSITION = 1 << 6,
    MONOTONIC_FLOOR = 1 << 7,
    HATLESS_PRUNING = 1 << 8,
};

#define NO_OFFSET (-1)
#define FOUND 1
#define NOT_FOUND 0
#define ABORTED (-1)

typedef struct { i64 offset, rank, buffer; } Candidate;
typedef struct { i64 key[4]; i64 buffer; } Keyed;
typedef struct { i64 *data; i64 len, cap; int failed; } Stack;

typedef struct {
    i64 n, num_sections;
    const i64 *size, *start, *end, *fixed, *first, *last;
    const i64 *sec_ptr, *sec_buf, *ov_ptr, *ov_buf;
    i64 capacity, flags;
    const char *heuristic;
    double deadline;
    const volatile int *cancel;  /* set by another thread to stop the search */
    i64 *offset, *solution, *min_off, *floor, *total, *cuts, *witness;
    i64 *members, *live, *mid_at, *loc, *span_ptr;  /* sections' members, unplaced first */
    Stack trail;  /* triples: kind (0 min offset, 1 floor), index, old value */
    Stack lists;  /* member and order lists of the open nodes */
    Candidate *cands;
    i64 cands_len, cands_cap;
    int oom;
    i64 nodes_left, nodes, backtracks;
} Search;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int reserve(Stack *s, i64 extra) {
    if (s->len + extra <= s->cap) return 1;
    i64 cap = s->cap ? s->cap : 1024;
    while (cap < s->len + extra) cap *= 2;
    i64 *data = realloc(s->data, (size_t)cap * sizeof(i64));
    if (!data) { s->failed = 1; return 0; }
    s->data = data;
    s->cap = cap;
    return 1;
}

static void push3(Search *S, i64 kind, i64 index, i64 old) {
    if (!reserve(&S->trail, 3)) { S->oom = 1; return; }
    S->trail.data[S->trail.len++] = kind;
    S->trail.data[S->trail.len++] = index;
    S->trail.data[S->trail.len++] = old;
}

static int reserve_cands(Search *S, i64 extra) {
    if (S->cands_len + extra <= S->cands_cap) return 1;
    i64 cap = S->cands_cap ? S->cands_cap : 1024;
    while (cap < S->cands_len + extra) cap *= 2;
    Candidate *c = realloc(S->cands, (size_t)cap * sizeof(Candidate));
    if (!c) { S->oom = 1; return 0; }
    S->cands = c;
    S->cands_cap = cap;
    return 1;
}

static int by_offset_then_rank(const void *a, const void *b) {
    const Candidate *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->rank < y->rank ? -1 : (x->rank > y->rank);
}

static int by_keys(const void *a, const void *b) {
    const Keyed *x = a, *y = b;
    for (int i = 0; i < 4; ++i)
        if (x->key[i] != y->key[i]) return x->key[i] < y->key[i] ? -1 : 1;
    return x->buffer < y->buffer ? -1 : (x->buffer > y->buffer);
}

static int search(Search *S, i64 members_at, i64 members_len, i64 order_at, i64 order_len, i64 lo, i64 hi,
                  i64 min_offset, i64 min_rank);

/* Insertion sort for the short arrays of one node (glibc's qsort allocates and copies). */
static void sort_candidates(Candidate *c, i64 n) {
    if (n > 64) { qsort(c, (size_t)n, sizeof(Candidate), by_offset_then_rank); return; }
    for (i64 i = 1; i < n; ++i) {
        Candidate x = c[i];
        i64 j = i - 1;
        while (j >= 0 && (c[j].offset > x.offset || (c[j].offset == x.offset && c[j].rank > x.rank))) {
            c[j + 1] = c[j];
            --j;
        }
        c[j + 1] = x;
    }
}

/* Preorder the members (at lists[members_at]) with the section totals as they are now, push
 * the order on the list stack, and search. */
static int sub_solve(Search *S, i64 members_at, i64 len, i64 lo, i64 hi) {
    if (!reserve(&S->lists, len)) { S->oom = 1; return ABORTED; }
    i64 order_at = S->lists.len;
    S->lists.len += len;
    i64 *lists = S->lists.data;
    if (S->flags & STATIC_PREORDERING) {
        Keyed *keyed = malloc((size_t)(len ? len : 1) * sizeof(Keyed));
        if (!keyed) { S->oom = 1; S->lists.len = order_at; return ABORTED; }
        for (i64 i = 0; i < len; ++i) {
            i64 b = lists[members_at + i];
            i64 width = S->end[b] - S->start[b];
            i64 most = 0;
            for (i64 s = S->first[b]; s < S->last[b]; ++s)
                if (S->total[s] > most) most = S->total[s];
            keyed[i].buffer = b;
            for (int k = 0; k < 4; ++k) {
                char c = S->heuristic[k];
                i64 v = 0;
                if (c == 'A') v = S->size[b] * width;
                else if (c == 'W') v = width;
                else if (c == 'T') v = most;
                else if (c == 'Z') v = S->size[b];
                keyed[i].key[k] = -v;
                if (c == 0) { for (int r = k; r < 4; ++r) keyed[i].key[r] = 0; break; }
            }
        }
        qsort(keyed, (size_t)len, sizeof(Keyed), by_keys);
        for (i64 i = 0; i < len; ++i) lists[order_at + i] = keyed[i].buffer;
        free(keyed);
    } else {
        memcpy(lists + order_at, lists + members_at, (size_t)len * sizeof(i64));
    }
    int result = search(S, members_at, len, order_at, len, lo, hi, 0, 0);
    S->lists.len = order_at;
    return result;
}

/* Lift the unplaced neighbours' lowest offsets to the top of b. Returns flags: 1 hatless (no
 * unplaced neighbour), 2 a fixed neighbour pushed past its offset. */
static int raise_neighbours(Search *S, i64 b, i64 offset) {
    i64 top = offset + S->size[b];
    int hatless = 1, broken = 0;
    for (i64 k = S->ov_ptr[b]; k < S->ov_ptr[b + 1]; ++k) {
        i64 o = S->ov_buf[k];
        if (S->offset[o] != NO_OFFSET) continue;
        hatless = 0;
        if (S->min_off[o] >= top) continue;
        push3(S, 0, o, S->min_off[o]);
        S->min_off[o] = top;
        if (S->fixed[o] >= 0 && top > S->fixed[o]) broken = 1;
    }
    return hatless | (broken << 1);
}

/* Move b behind the unplaced members of each of its sections. */
static void take(Search *S, i64 b) {
    for (i64 s = S->first[b]; s < S->last[b]; ++s) {
        i64 mid = S->span_ptr[b] + s - S->first[b];
        i64 k = S->loc[mid], j = S->sec_ptr[s] + S->live[s] - 1;
        i64 other = S->mid_at[j];
        S->members[k] = S->members[j];
        S->mid_at[k] = other;
        S->loc[other] = k;
        S->members[j] = b;
        S->mid_at[j] = mid;
        S->loc[mid] = j;
        S->live[s] -= 1;
    }
}

/* Undo take(b): b is the first member behind the unplaced ones (everything since was undone). */
static void give_back(Search *S, i64 b) {
    for (i64 s = S->first[b]; s < S->last[b]; ++s) S->live[s] += 1;
}

/* Sections of b: floor to its top, its bytes no longer unplaced. */
static void update_sections(Search *S, i64 b, i64 offset) {
    i64 top = offset + S->size[b];
    for (i64 s = S->first[b]; s < S->last[b]; ++s) {
        push3(S, 1, s, S->floor[s]);
        S->floor[s] = top;
        S->total[s] -= S->size[b];
    }
}

/* True if some unplaced member of section s can start at or below limit. Each section keeps its
 * unplaced members first (live[s] of them, see take/give_back); witness[s] remembers the last
 * one found: a cache, checked before use, that spares most scans. */
static int some_member_at_most(Search *S, i64 s, i64 limit) {
    i64 begin = S->sec_ptr[s], end = begin + S->live[s];
    if (begin == end) return 1;  /* nothing unplaced: no floor from it */
    i64 w = S->witness[s];
    if (w >= begin && w < end && S->min_off[S->members[w]] <= limit) return 1;
    for (i64 k = begin; k < end; ++k) {
        if (S->min_off[S->members[k]] <= limit) {
            S->witness[s] = k;
            return 1;
        }
    }
    return 0;
}

static void restore(Search *S, i64 b, i64 trail_mark) {
    while (S->trail.len > trail_mark) {
        S->trail.len -= 3;
        i64 kind = S->trail.data[S->trail.len], index = S->trail.data[S->trail.len + 1];
        i64 old = S->trail.data[S->trail.len + 2];
        if (kind == 0) S->min_off[index] = old;
        else S->floor[index] = old;
    }
    for (i64 s = S->first[b]; s < S->last[b]; ++s) S->total[s] += S->size[b];
    give_back(S, b);
    S->offset[b] = NO_OFFSET;
}

static int section_fits(Search *S, i64 s, i64 offset) {
    i64 f = S->floor[s];
    if ((S->flags & MONOTONIC_FLOOR) && f < offset) f = offset;
    i64 rest = (S->flags & SECTION_INFERENCE) ? S->total[s] : 0;
    return f + rest <= S->capacity;
}

static int section_floor_fits(Search *S, i64 s) {
    i64 rest = (S->flags & SECTION_INFERENCE) ? S->total[s] : 0;
    return !(S->flags & UNALLOCATED_FLOOR) || some_member_at_most(S, s, S->capacity - rest);
}

/* No section of the partition overflows (see ReferenceSearch._check): the same verdict, reached
 * sooner when it fails by looking first at the sections of b (just placed), then at the cheap
 * test everywhere, then at the unplaced buffers' lowest offsets everywhere. */
static int check(Search *S, i64 lo, i64 hi, i64 offset, i64 b) {
    i64 a = S->first[b] > lo ? S->first[b] : lo, z = S->last[b] < hi ? S->last[b] : hi;
    for (i64 s = a; s < z; ++s)
        if (!section_fits(S, s, offset) || !section_floor_fits(S, s)) return 0;
    for (i64 s = lo; s < hi; ++s)
        if (!section_fits(S, s, offset)) return 0;
    for (i64 s = lo; s < hi; ++s)
        if ((s < a || s >= z) && !section_floor_fits(S, s)) return 0;
    return 1;
}

static int decompose(Search *S, i64 members_at, i64 members_len, i64 order_at, i64 order_len, i64 lo, i64 hi,
                     i64 offset, i64 rank, i64 b) {
    S->solution[b] = offset;
    i64 first = S->first[b], last = S->last[b];
    i64 points_at = S->lists.len, num_points = 0;
    if (!reserve(&S->lists, last - first + 2)) { S->oom = 1; return ABORTED; }
    S->lists.data[S->lists.len++] = lo;
    num_points = 1;
    for (i64 s = first; s < last - 1; ++s) {
        S->cuts[s] -= 1;
        if (S->cuts[s] == 0) { S->lists.data[S->lists.len++] = s + 1; ++num_points; }
    }
    int result;
    if (num_points == 1) {
        result = search(S, members_at, members_len, order_at, order_len, lo, hi, offset, rank);
    } else {
        S->lists.data[S->lists.len++] = hi;
        ++num_points;
        result = FOUND;
        for (i64 p = 1; p < num_points && result == FOUND; ++p) {
            i64 a = S->lists.data[points_at + p - 1], z = S->lists.data[points_at + p];
            if (!reserve(&S->lists, members_len)) { S->oom = 1; result = ABORTED; break; }
            i64 part_at = S->lists.len, part_len = 0;
            for (i64 i = 0; i < members_len; ++i) {
                i64 o = S->lists.data[members_at + i];
                if (S->offset[o] == NO_OFFSET && !(S->last[o] <= a || z <= S->first[o]))
                    S->lists.data[part_at + part_len++] = o;
            }
            S->lists.len += part_len;
            if (part_len) result = sub_solve(S, part_at, part_len, a, z);
            S->lists.len = part_at;
        }
    }
    for (i64 s = first; s < last - 1; ++s) S->cuts[s] += 1;
    S->lists.len = points_at;
    return result;
}

static int search(Search *S, i64 members_at, i64 members_len, i64 order_at, i64 order_len, i64 lo, i64 hi,
                  i64 min_offset, i64 min_rank) {
    S->nodes_left -= 1;
    if (S->nodes_left < 0 || S->oom) return ABORTED;
    S->nodes += 1;
    if ((S->nodes & 255) == 0 && (now_seconds() > S->deadline || (S->cancel && *S->cancel))) return ABORTED;
    /* Only the candidates that pass the canonical, dominance and fixed-offset tests are kept (in
     * rank order, then sorted): the same ones, in the same order, that the reference tries. */
    if (!reserve_cands(S, order_len)) return ABORTED;
    i64 cands_at = S->cands_len, count = 0, unplaced = 0, min_height = -1;
    const i64 *order = S->lists.data + order_at;
    for (i64 r = 0; r < order_len; ++r) {
        i64 b = order[r];
        if (S->offset[b] != NO_OFFSET) continue;
        ++unplaced;
        i64 offset = S->min_off[b];
        i64 h = offset + S->size[b];
        if (min_height < 0 || h < min_height) min_height = h;
        if ((S->flags & CANONICAL_ONLY) && (offset < min_offset || (offset == min_offset && r < min_rank))) continue;
        if (S->fixed[b] >= 0 && offset > S->fixed[b]) continue;
        Candidate *c = &S->cands[cands_at + count++];
        c->offset = offset;
        c->rank = r;
        c->buffer = b;
    }
    if (unplaced == 0) {
        for (i64 i = 0; i < members_len; ++i) {
            i64 b = S->lists.data[members_at + i];
            S->solution[b] = S->offset[b];
        }
        return FOUND;
    }
    if (S->flags & CHECK_DOMINANCE) {
        i64 kept = 0;
        for (i64 i = 0; i < count; ++i)
            if (S->cands[cands_at + i].offset < min_height) S->cands[cands_at + kept++] = S->cands[cands_at + i];
        count = kept;
    }
    S->cands_len += count;
    if (S->flags & DYNAMIC_ORDERING) sort_candidates(S->cands + cands_at, count);
    int result = NOT_FOUND;
    for (i64 i = 0; i < count; ++i) {
        Candidate c = S->cands[cands_at + i];  /* a copy: the array may move below */
        i64 b = c.buffer;
        i64 trail_mark = S->trail.len, lists_mark = S->lists.len;
        S->offset[b] = c.offset;
        take(S, b);
        int raised = raise_neighbours(S, b, c.offset);
        update_sections(S, b, c.offset);
        S->lists.len = lists_mark;
        int found = NOT_FOUND;
        if (S->oom) found = ABORTED;
        else if (!(raised & 2) && check(S, lo, hi, c.offset, b)) {
            found = (S->flags & DYNAMIC_DECOMPOSITION)
                        ? decompose(S, members_at, members_len, order_at, order_len, lo, hi, c.offset, c.rank, b)
                        : search(S, members_at, members_len, order_at, order_len, lo, hi, c.offset, c.rank);
        }
        restore(S, b, trail_mark);
        if (found != NOT_FOUND) { result = found; break; }
        if ((raised & 1) && (S->flags & HATLESS_PRUNING)) break;
    }
    S->cands_len = cands_at;
    if (result == NOT_FOUND) S->backtracks += 1;
    return result;
}

int mm_search(i64 n, const i64 *size, const i64 *start, const i64 *end, const i64 *fixed, i64 num_sections,
              const i64 *first, const i64 *last, const i64 *sec_ptr, const i64 *sec_buf, const i64 *ov_ptr,
              const i64 *ov_buf, i64 num_partitions, const i64 *part_ptr, const i64 *part_buf, const i64 *part_lo,
              const i64 *part_hi, i64 capacity, i64 flags, const char *heuristic, i64 node_limit,
              double seconds_left, const volatile int *cancel, i64 *solution_out, i64 *stats_out) {
    Search S;
    memset(&S, 0, sizeof S);
    S.n = n;
    S.num_sections = num_sections;
    S.size = size; S.start = start; S.end = end; S.fixed = fixed; S.first = first; S.last = last;
    S.sec_ptr = sec_ptr; S.sec_buf = sec_buf; S.ov_ptr = ov_ptr; S.ov_buf = ov_buf;
    S.capacity = capacity;
    S.flags = flags;
    S.heuristic = heuristic;
    S.deadline = now_seconds() + seconds_left;
    S.cancel = cancel;
    S.nodes_left = node_limit >= 0 ? node_limit : INT64_MAX;
    size_t nb = (size_t)(n ? n : 1) * sizeof(i64), ns = (size_t)(num_sections ? num_sections : 1) * sizeof(i64);
    S.offset = malloc(nb); S.solution = calloc(1, nb); S.min_off = malloc(nb);
    S.floor = calloc(1, ns); S.total = calloc(1, ns); S.cuts = calloc(1, ns); S.witness = calloc(1, ns);
    S.live = calloc(1, ns); S.span_ptr = calloc(1, (size_t)(n + 1) * sizeof(i64));
    i64 entries = num_sections ? sec_ptr[num_sections] : 0;
    size_t ne = (size_t)(entries ? entries : 1) * sizeof(i64);
    S.members = malloc(ne); S.mid_at = malloc(ne); S.loc = malloc(ne);
    int result = ABORTED;
    if (S.offset && S.solution && S.min_off && S.floor && S.total && S.cuts && S.witness && S.live && S.span_ptr && S.members && S.mid_at && S.loc) {
        for (i64 b = 0; b < n; ++b) {
            S.offset[b] = NO_OFFSET;
            S.min_off[b] = fixed[b] > 0 ? fixed[b] : 0;
        }
        for (i64 b = 0; b < n; ++b) S.span_ptr[b + 1] = S.span_ptr[b] + last[b] - first[b];
        for (i64 s = 0; s < num_sections; ++s) {
            S.witness[s] = sec_ptr[s];
            S.live[s] = sec_ptr[s + 1] - sec_ptr[s];
            for (i64 k = sec_ptr[s]; k < sec_ptr[s + 1]; ++k) {
                i64 b = sec_buf[k], mid = S.span_ptr[b] + s - first[b];
                S.total[s] += size[b];
                S.members[k] = b;
                S.mid_at[k] = mid;
                S.loc[mid] = k;
            }
        }
        for (i64 b = 0; b < n; ++b)
            for (i64 s = first[b]; s < last[b] - 1; ++s) S.cuts[s] += 1;
        result = FOUND;
        for (i64 p = 0; p < num_partitions && result == FOUND; ++p) {
            i64 len = part_ptr[p + 1] - part_ptr[p];
            if (!reserve(&S.lists, len)) { result = ABORTED; break; }
            i64 at = S.lists.len;
            memcpy(S.lists.data + at, part_buf + part_ptr[p], (size_t)len * sizeof(i64));
            S.lists.len += len;
            result = sub_solve(&S, at, len, part_lo[p], part_hi[p]);
            S.lists.len = at;
        }
        if (result == FOUND) memcpy(solution_out, S.solution, (size_t)n * sizeof(i64));
    }
    stats_out[0] = S.nodes;
    stats_out[1] = S.backtracks;
    stats_out[2] = S.oom;
    free(S.offset); free(S.solution); free(S.min_off); free(S.floor); free(S.total); free(S.cuts); free(S.witness);
    free(S.live); free(S.span_ptr); free(S.members); free(S.mid_at); free(S.loc);
    free(S.trail.data); free(S.lists.data); free(S.cands);
    return result;
}
