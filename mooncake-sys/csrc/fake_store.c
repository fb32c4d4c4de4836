/*
 * A fake libmooncake_store.so: the C surface of Mooncake Store's store_c.h
 * over a bounded in-process table, for kvferry's tests. Loaded by path
 * exactly as the real library is (MOONCAKE_STORE_LIB). Values live in the
 * library, shared by every client of the process (as a master's segments
 * are shared by its clients).
 *
 *   setup fails (-1) for a master address starting with "unreachable".
 *   puts and gets must name memory registered with register_buffer
 *   (INVALID_PARAMS otherwise, counted: fake_store_stats()[2]).
 *   a put past the capacity (fake_store_capacity) is NO_AVAILABLE_HANDLE;
 *   a put of a stored key is OBJECT_ALREADY_EXISTS;
 *   a get of a missing key is OBJECT_NOT_FOUND, of a value longer than the
 *   buffer INVALID_PARAMS; otherwise it returns the value's length;
 *   fake_store_corrupt(key) flips a stored byte: its gets then answer
 *   CHECKSUM_MISMATCH, as the real store's checksums do.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "store_c.h"

#define MAX_VALUES 65536
#define MAX_BUFFERS 1024
#define NO_AVAILABLE_HANDLE (-200)
#define INVALID_PARAMS (-600)
#define OBJECT_NOT_FOUND (-704)
#define OBJECT_ALREADY_EXISTS (-705)
#define CHECKSUM_MISMATCH (-801)

struct value { char *key; uint8_t *bytes; size_t len; uint32_t sum; };
struct client { struct { uint64_t addr, len; } buffers[MAX_BUFFERS]; int nbuffers; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct value values[MAX_VALUES];
static size_t used_bytes, capacity_bytes = (size_t)1 << 30;
static int64_t n_puts, n_gets, n_unregistered;

static uint32_t sum(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

static struct value *find(const char *key) {
    for (int i = 0; i < MAX_VALUES; i++)
        if (values[i].key && !strcmp(values[i].key, key)) return &values[i];
    return NULL;
}

static int registered(const struct client *c, const void *p, size_t n) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    for (int i = 0; i < c->nbuffers; i++)
        if (a >= c->buffers[i].addr && n <= c->buffers[i].len && a - c->buffers[i].addr <= c->buffers[i].len - n)
            return 1;
    return 0;
}

mooncake_store_t mooncake_store_create(void) { return calloc(1, sizeof(struct client)); }

void mooncake_store_destroy(mooncake_store_t s) { free(s); }

int mooncake_store_setup(mooncake_store_t s, const char *host, const char *meta, uint64_t global,
                         uint64_t local, const char *proto, const char *dev, const char *master) {
    (void)s; (void)host; (void)meta; (void)global; (void)local; (void)proto; (void)dev;
    return strncmp(master, "unreachable", 11) ? 0 : -1;
}

int mooncake_store_register_buffer(mooncake_store_t s, void *buf, size_t size) {
    struct client *c = s;
    if (c->nbuffers >= MAX_BUFFERS) return -1;
    c->buffers[c->nbuffers].addr = (uint64_t)(uintptr_t)buf;
    c->buffers[c->nbuffers].len = size;
    c->nbuffers++;
    return 0;
}

int mooncake_store_unregister_buffer(mooncake_store_t s, void *buf) {
    struct client *c = s;
    for (int i = 0; i < c->nbuffers; i++) {
        if (c->buffers[i].addr == (uint64_t)(uintptr_t)buf) {
            c->buffers[i] = c->buffers[--c->nbuffers];
            return 0;
        }
    }
    return -1;
}

static int put_one(struct client *c, const char *key, const void *buf, size_t n) {
    if (!registered(c, buf, n)) { n_unregistered++; return INVALID_PARAMS; }
    if (find(key)) return OBJECT_ALREADY_EXISTS;
    if (used_bytes + n > capacity_bytes) return NO_AVAILABLE_HANDLE;
    for (int i = 0; i < MAX_VALUES; i++) {
        if (!values[i].key) {
            values[i].key = strdup(key);
            values[i].bytes = malloc(n ? n : 1);
            memcpy(values[i].bytes, buf, n);
            values[i].len = n;
            values[i].sum = sum(buf, n);
            used_bytes += n;
            n_puts++;
            return 0;
        }
    }
    return NO_AVAILABLE_HANDLE;
}

int mooncake_store_batch_put_from(mooncake_store_t s, const char **keys, void **bufs,
                                  const size_t *sizes, size_t count,
                                  const mooncake_replicate_config_t *cfg, int *out) {
    (void)cfg;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++) out[i] = put_one(s, keys[i], bufs[i], sizes[i]);
    pthread_mutex_unlock(&mu);
    return 0;
}

static int64_t get_one(struct client *c, const char *key, void *buf, size_t n) {
    if (!registered(c, buf, n)) { n_unregistered++; return INVALID_PARAMS; }
    struct value *v = find(key);
    if (!v) return OBJECT_NOT_FOUND;
    if (v->len > n) return INVALID_PARAMS;
    if (sum(v->bytes, v->len) != v->sum) return CHECKSUM_MISMATCH;
    memcpy(buf, v->bytes, v->len);
    n_gets++;
    return (int64_t)v->len;
}

int mooncake_store_batch_get_into(mooncake_store_t s, const char **keys, void **bufs,
                                  const size_t *sizes, size_t count, int64_t *out) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++) out[i] = get_one(s, keys[i], bufs[i], sizes[i]);
    pthread_mutex_unlock(&mu);
    return 0;
}

int mooncake_store_batch_is_exist(mooncake_store_t s, const char **keys, size_t count, int *out) {
    (void)s;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++) out[i] = find(keys[i]) != NULL;
    pthread_mutex_unlock(&mu);
    return 0;
}

int mooncake_store_remove(mooncake_store_t s, const char *key, int force) {
    (void)s; (void)force;
    pthread_mutex_lock(&mu);
    struct value *v = find(key);
    int rc = OBJECT_NOT_FOUND;
    if (v) {
        used_bytes -= v->len;
        free(v->key); free(v->bytes);
        memset(v, 0, sizeof *v);
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* ---- control, for tests only ---- */

void fake_store_capacity(uint64_t bytes) {
    pthread_mutex_lock(&mu);
    capacity_bytes = bytes;
    pthread_mutex_unlock(&mu);
}

/* Flips the first byte of `key`'s value; 0 if it was there. */
int fake_store_corrupt(const char *key) {
    pthread_mutex_lock(&mu);
    struct value *v = find(key);
    if (v && v->len) v->bytes[0] ^= 0xFF;
    pthread_mutex_unlock(&mu);
    return v ? 0 : -1;
}

/* Flips the first byte of every stored value that starts with `first`;
 * how many. */
int fake_store_corrupt_starting_with(int first) {
    int n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_VALUES; i++) {
        if (values[i].key && values[i].len && values[i].bytes[0] == (uint8_t)first) {
            values[i].bytes[0] ^= 0xFF;
            n++;
        }
    }
    pthread_mutex_unlock(&mu);
    return n;
}

/* Drops every value. */
void fake_store_clear(void) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_VALUES; i++) {
        free(values[i].key); free(values[i].bytes);
        memset(&values[i], 0, sizeof values[i]);
    }
    used_bytes = 0;
    pthread_mutex_unlock(&mu);
}

/* puts, gets, calls naming unregistered memory */
void fake_store_stats(int64_t out[3]) {
    pthread_mutex_lock(&mu);
    out[0] = n_puts; out[1] = n_gets; out[2] = n_unregistered;
    pthread_mutex_unlock(&mu);
}
