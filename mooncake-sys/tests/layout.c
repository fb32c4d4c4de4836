/* Prints the size and field offsets of every struct mooncake-sys declares,
 * as the vendored headers define them: one "name value" per line. */
#include <stddef.h>
#include <stdio.h>

#include "store_c.h"
#include "transfer_engine_c.h"

#define P(name, value) printf("%s %zu\n", name, (size_t)(value))

int main(void) {
    P("transfer_request", sizeof(struct transfer_request));
    P("transfer_request.opcode", offsetof(struct transfer_request, opcode));
    P("transfer_request.source", offsetof(struct transfer_request, source));
    P("transfer_request.target_id", offsetof(struct transfer_request, target_id));
    P("transfer_request.target_offset", offsetof(struct transfer_request, target_offset));
    P("transfer_request.length", offsetof(struct transfer_request, length));
    P("transfer_status", sizeof(struct transfer_status));
    P("transfer_status.status", offsetof(struct transfer_status, status));
    P("transfer_status.transferred_bytes", offsetof(struct transfer_status, transferred_bytes));
    P("notify_msg", sizeof(struct notify_msg));
    P("notify_msg.name", offsetof(struct notify_msg, name));
    P("notify_msg.msg", offsetof(struct notify_msg, msg));
    P("buffer_entry", sizeof(struct buffer_entry));
    P("buffer_entry.addr", offsetof(struct buffer_entry, addr));
    P("buffer_entry.length", offsetof(struct buffer_entry, length));
    P("replicate_config", sizeof(struct mooncake_replicate_config));
    P("replicate_config.replica_num", offsetof(struct mooncake_replicate_config, replica_num));
    P("replicate_config.with_soft_pin", offsetof(struct mooncake_replicate_config, with_soft_pin));
    P("replicate_config.with_hard_pin", offsetof(struct mooncake_replicate_config, with_hard_pin));
    P("replicate_config.preferred_segments",
      offsetof(struct mooncake_replicate_config, preferred_segments));
    P("replicate_config.preferred_segments_count",
      offsetof(struct mooncake_replicate_config, preferred_segments_count));
    P("segment_id_t", sizeof(segment_id_t));
    P("batch_id_t", sizeof(batch_id_t));
    P("INVALID_BATCH_is_max", INVALID_BATCH == UINT64_MAX);
    P("OPCODE_READ", OPCODE_READ);
    P("OPCODE_WRITE", OPCODE_WRITE);
    P("STATUS_WAITING", STATUS_WAITING);
    P("STATUS_PENDING", STATUS_PENDING);
    P("STATUS_INVALID", STATUS_INVALID);
    P("STATUS_CANCELED", STATUS_CANCELED);
    P("STATUS_COMPLETED", STATUS_COMPLETED);
    P("STATUS_TIMEOUT", STATUS_TIMEOUT);
    P("STATUS_FAILED", STATUS_FAILED);
    return 0;
}
