//! The properties the `lookup_msg_decode` target checks on every input,
//! shared with the test that replays its seeds and corpus
//! (`tests/it/fuzz_seeds.rs`). Every property failure panics.

use kvferry_store::internal::lookup::wire::{
    decode_query, decode_reply, encode_query, encode_reply, LookupWireError, LOOKUP_HASHES_MAX,
    LOOKUP_MESSAGE_MAX_BYTES,
};

/// What the bytes decoded as.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decoded {
    /// A lookup request.
    Query,
    /// A lookup reply.
    Reply,
    /// Neither.
    Nothing,
}

/// Both decoders on `data`: neither panics, a message longer than the
/// bound is refused as such, and what decodes is within the bounds and
/// decodes to itself again once re-encoded.
pub(super) fn check_lookup_msg(data: &[u8]) -> Decoded {
    let query = decode_query(data);
    let reply = decode_reply(data);
    if data.len() > LOOKUP_MESSAGE_MAX_BYTES {
        let too_large = LookupWireError::TooLarge { len: data.len() };
        assert_eq!(query.as_ref().err(), Some(&too_large));
        assert_eq!(reply.as_ref().err(), Some(&too_large));
    }
    if let Ok((seq, q)) = &query {
        let hashes: usize = q.block_hashes.iter().map(Vec::len).sum();
        assert!(hashes <= LOOKUP_HASHES_MAX);
        let again = encode_query(*seq, q).expect("a decoded query re-encodes");
        assert_eq!(decode_query(&again).as_ref(), Ok(&(*seq, q.clone())));
        return Decoded::Query;
    }
    if let Ok((seq, a)) = &reply {
        let again = encode_reply(*seq, a).expect("a decoded reply re-encodes");
        assert_eq!(decode_reply(&again).as_ref(), Ok(&(*seq, a.clone())));
        return Decoded::Reply;
    }
    Decoded::Nothing
}
