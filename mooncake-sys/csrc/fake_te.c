/*
 * A fake libtransfer_engine.so: the C surface of Mooncake's
 * transfer_engine_c.h implemented with memcpy between engines of one
 * process, for kvferry's tests. Loaded by path exactly as the real library
 * is (MOONCAKE_TE_LIB).
 *
 * Segments: an engine is named "127.0.0.1:<port>" (ports from 21000 up,
 * one per engine); openSegment finds the engine of that name. Every task
 * is checked against registered memory on both ends: a local range outside
 * the initiator's registrations fails the submit (ERR_ADDRESS_NOT_REGISTERED,
 * as the real engine does), a remote range outside the target's fails the
 * task. The counters fake_te_stats() reports let a test see that kvferry
 * never asked for either.
 *
 * Faults, armed by fake_te_fault(kind, count, arg) for the next `count`
 * submits (FAKE_SUBMIT_FAIL) or tasks (the others):
 *   FAKE_SUBMIT_FAIL  submitTransfer returns an error, nothing moves
 *   FAKE_TASK_FAILED  the task ends STATUS_FAILED, nothing moves
 *   FAKE_TASK_TIMEOUT the task ends STATUS_TIMEOUT, nothing moves
 *   FAKE_LATE         the task stays PENDING until `arg` ms after its submit,
 *                     then moves its bytes (late: at the first status poll
 *                     after that) and completes
 *   FAKE_NEVER        the task stays PENDING until fake_te_finish_never()
 *   FAKE_WRONG_BYTES  the bytes move, transferred_bytes says one less
 * freeBatchID refuses a batch with an unfinished task (kBatchBusy = 4).
 * allocateBatchID and freeBatchID are counted.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

#define MAX_ENGINES 256
#define MAX_REGIONS 4096
#define CODE_INVALID_ARGUMENT 1
#define CODE_ADDRESS_NOT_REGISTERED 3
#define CODE_BATCH_BUSY 4

enum { FAKE_NONE, FAKE_SUBMIT_FAIL, FAKE_TASK_FAILED, FAKE_TASK_TIMEOUT,
       FAKE_LATE, FAKE_NEVER, FAKE_WRONG_BYTES };

struct region { uint64_t addr, len; };
struct engine {
    int live;
    char name[64];
    struct region regions[MAX_REGIONS];
    int nregions;
};
struct task {
    int status;           /* STATUS_* */
    int fault;            /* FAKE_LATE / FAKE_NEVER while pending */
    int64_t due_ns;       /* FAKE_LATE: when it moves its bytes */
    int64_t generation;   /* FAKE_NEVER: fake_te_finish_never() ends it */
    uint64_t transferred;
    struct transfer_request req;
    int target;           /* engine index */
};
struct batch {
    size_t capacity, count;
    int engine;
    struct task tasks[];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct engine engines[MAX_ENGINES];
static int fault_kind, fault_count;
static int64_t fault_arg;
static int64_t n_alloc, n_free, n_submit_refused, n_task_refused, n_tasks;
/* Registrations at a device location: any but "cpu:N" and "*" ("cuda:N";
 * a test's stand-in device is "host:N"). */
static int64_t n_device_regions;
static int64_t never_generation;

static int engine_index(transfer_engine_t e) { return (int)(intptr_t)e - 1; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int inside(const struct engine *e, uint64_t addr, uint64_t len) {
    for (int i = 0; i < e->nregions; i++) {
        const struct region *r = &e->regions[i];
        if (addr >= r->addr && len <= r->len && addr - r->addr <= r->len - len) return 1;
    }
    return 0;
}

transfer_engine_t createTransferEngine(const char *metadata, const char *name,
                                       const char *ip, uint64_t rpc_port, int auto_discover) {
    (void)metadata; (void)name; (void)ip; (void)rpc_port; (void)auto_discover;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ENGINES; i++) {
        if (!engines[i].live && engines[i].name[0] == 0) {
            engines[i].live = 1;
            snprintf(engines[i].name, sizeof engines[i].name, "127.0.0.1:%d", 21000 + i);
            pthread_mutex_unlock(&mu);
            return (transfer_engine_t)(intptr_t)(i + 1);
        }
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

int getLocalIpAndPort(transfer_engine_t e, char *buf, size_t len) {
    int i = engine_index(e);
    if (i < 0 || i >= MAX_ENGINES || !engines[i].live) return CODE_INVALID_ARGUMENT;
    if (strlen(engines[i].name) + 1 > len) return CODE_INVALID_ARGUMENT;
    strcpy(buf, engines[i].name);
    return 0;
}

transport_t installTransport(transfer_engine_t e, const char *proto, void **args) {
    (void)args;
    if (strcmp(proto, "tcp") && strcmp(proto, "rdma")) return NULL;
    return (transport_t)e;
}

void destroyTransferEngine(transfer_engine_t e) {
    pthread_mutex_lock(&mu);
    int i = engine_index(e);
    engines[i].live = 0;   /* its name stays taken: segments are never reused */
    engines[i].nregions = 0;
    pthread_mutex_unlock(&mu);
}

int registerLocalMemory(transfer_engine_t e, void *addr, size_t len, const char *loc, int remote) {
    (void)remote;
    pthread_mutex_lock(&mu);
    struct engine *en = &engines[engine_index(e)];
    int rc = CODE_INVALID_ARGUMENT;
    if (en->nregions < MAX_REGIONS && len > 0) {
        en->regions[en->nregions++] = (struct region){(uint64_t)(uintptr_t)addr, len};
        if (loc && strncmp(loc, "cpu", 3) != 0 && strcmp(loc, "*") != 0) n_device_regions++;
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

int unregisterLocalMemory(transfer_engine_t e, void *addr) {
    pthread_mutex_lock(&mu);
    struct engine *en = &engines[engine_index(e)];
    int rc = CODE_ADDRESS_NOT_REGISTERED;
    for (int i = 0; i < en->nregions; i++) {
        if (en->regions[i].addr == (uint64_t)(uintptr_t)addr) {
            en->regions[i] = en->regions[--en->nregions];
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

int registerLocalMemoryBatch(transfer_engine_t e, buffer_entry_t *list, size_t n, const char *loc) {
    for (size_t i = 0; i < n; i++) {
        int rc = registerLocalMemory(e, list[i].addr, list[i].length, loc, 1);
        if (rc) return rc;
    }
    return 0;
}

int unregisterLocalMemoryBatch(transfer_engine_t e, void **addrs, size_t n) {
    int rc = 0;
    for (size_t i = 0; i < n; i++) rc |= unregisterLocalMemory(e, addrs[i]);
    return rc;
}

segment_id_t openSegment(transfer_engine_t e, const char *name) {
    (void)e;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ENGINES; i++) {
        if (engines[i].live && !strcmp(engines[i].name, name)) {
            pthread_mutex_unlock(&mu);
            return i + 1;
        }
    }
    pthread_mutex_unlock(&mu);
    return -1;
}

int closeSegment(transfer_engine_t e, segment_id_t id) { (void)e; (void)id; return 0; }

batch_id_t allocateBatchID(transfer_engine_t e, size_t n) {
    struct batch *b = calloc(1, sizeof *b + n * sizeof(struct task));
    if (!b) return INVALID_BATCH;
    b->capacity = n;
    b->engine = engine_index(e);
    pthread_mutex_lock(&mu);
    n_alloc++;
    pthread_mutex_unlock(&mu);
    return (batch_id_t)(uintptr_t)b;
}

/* Moves a task's bytes; under mu. The remote range is checked here, at the
 * time the bytes move (a late task checks against what is registered then). */
static void move(struct task *t) {
    struct engine *target = &engines[t->target];
    const struct transfer_request *r = &t->req;
    if (!target->live || !inside(target, r->target_offset, r->length)) {
        n_task_refused++;
        t->status = STATUS_FAILED;
        return;
    }
    void *remote = (void *)(uintptr_t)r->target_offset;
    if (r->opcode == OPCODE_WRITE) memcpy(remote, r->source, r->length);
    else memcpy(r->source, remote, r->length);
    t->transferred = r->length;
    t->status = STATUS_COMPLETED;
}

static int take_fault(void) {
    if (fault_count <= 0 || fault_kind == FAKE_SUBMIT_FAIL) return FAKE_NONE;
    fault_count--;
    return fault_kind;
}

static void start(struct task *t) {
    int f = take_fault();
    n_tasks++;
    switch (f) {
    case FAKE_TASK_FAILED: t->status = STATUS_FAILED; break;
    case FAKE_TASK_TIMEOUT: t->status = STATUS_TIMEOUT; break;
    case FAKE_LATE:
        t->status = STATUS_PENDING; t->fault = f; t->due_ns = now_ns() + fault_arg * 1000000;
        break;
    case FAKE_NEVER:
        t->status = STATUS_PENDING; t->fault = f; t->generation = never_generation;
        break;
    case FAKE_WRONG_BYTES:
        move(t);
        if (t->status == STATUS_COMPLETED) t->transferred = t->req.length - 1;
        break;
    default: move(t);
    }
}

int submitTransfer(transfer_engine_t e, batch_id_t id, struct transfer_request *reqs, size_t n) {
    struct batch *b = (struct batch *)(uintptr_t)id;
    int rc = 0;
    pthread_mutex_lock(&mu);
    struct engine *self = &engines[engine_index(e)];
    if (b->count + n > b->capacity) rc = CODE_INVALID_ARGUMENT;
    for (size_t i = 0; !rc && i < n; i++) {
        int target = reqs[i].target_id - 1;
        if (target < 0 || target >= MAX_ENGINES || reqs[i].length == 0) rc = CODE_INVALID_ARGUMENT;
        else if (!inside(self, (uint64_t)(uintptr_t)reqs[i].source, reqs[i].length))
            rc = CODE_ADDRESS_NOT_REGISTERED;
    }
    if (!rc && fault_kind == FAKE_SUBMIT_FAIL && fault_count > 0) {
        fault_count--;
        rc = CODE_INVALID_ARGUMENT; /* an injected failure, not counted as refused */
    }
    if (rc == CODE_ADDRESS_NOT_REGISTERED) n_submit_refused++;
    if (!rc) {
        for (size_t i = 0; i < n; i++) {
            struct task *t = &b->tasks[b->count++];
            t->req = reqs[i];
            t->target = reqs[i].target_id - 1;
            start(t);
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* A FAKE_NEVER task ends, nothing moved, once fake_te_finish_never() ran
 * after it started; under mu. */
static void settle_never(struct task *t) {
    if (t->status == STATUS_PENDING && t->fault == FAKE_NEVER && never_generation > t->generation) {
        t->fault = FAKE_NONE;
        t->status = STATUS_FAILED;
    }
}

int getTransferStatus(transfer_engine_t e, batch_id_t id, size_t task, struct transfer_status *st) {
    (void)e;
    struct batch *b = (struct batch *)(uintptr_t)id;
    pthread_mutex_lock(&mu);
    if (task >= b->count) {
        pthread_mutex_unlock(&mu);
        return CODE_INVALID_ARGUMENT;
    }
    struct task *t = &b->tasks[task];
    if (t->status == STATUS_PENDING && t->fault == FAKE_LATE && now_ns() >= t->due_ns) {
        t->fault = FAKE_NONE;
        move(t);
    }
    settle_never(t);
    st->status = t->status;
    st->transferred_bytes = t->transferred;
    pthread_mutex_unlock(&mu);
    return 0;
}

int freeBatchID(transfer_engine_t e, batch_id_t id) {
    (void)e;
    struct batch *b = (struct batch *)(uintptr_t)id;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < b->count; i++) {
        settle_never(&b->tasks[i]);
        if (b->tasks[i].status == STATUS_PENDING || b->tasks[i].status == STATUS_WAITING) {
            pthread_mutex_unlock(&mu);
            return CODE_BATCH_BUSY;
        }
    }
    n_free++;
    pthread_mutex_unlock(&mu);
    free(b);
    return 0;
}

/* ---- control, for tests only ---- */

void fake_te_fault(int kind, int count, int64_t arg) {
    pthread_mutex_lock(&mu);
    fault_kind = kind;
    fault_count = count;
    fault_arg = arg;
    pthread_mutex_unlock(&mu);
}

/* allocated, freed, submits refused for a bad range, tasks refused for a bad
 * remote range, tasks started, registrations at a device location */
void fake_te_stats(int64_t out[6]) {
    pthread_mutex_lock(&mu);
    out[0] = n_alloc; out[1] = n_free; out[2] = n_submit_refused;
    out[3] = n_task_refused; out[4] = n_tasks; out[5] = n_device_regions;
    pthread_mutex_unlock(&mu);
}

/* Ends every FAKE_NEVER task started so far as STATUS_FAILED (nothing
 * moved), as its next status poll or free sees it. */
void fake_te_finish_never(void) {
    pthread_mutex_lock(&mu);
    never_generation++;
    pthread_mutex_unlock(&mu);
}
