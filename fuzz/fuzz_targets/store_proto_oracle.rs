//! The properties of the store server's control protocol
//! (`kvferry_store::internal::proto`) on arbitrary bytes, shared by the fuzz target
//! and the seed replay in `tests/it/fuzz_seeds.rs`: a frame is a header and
//! a body; whatever decodes (as a request or as a reply) re-encodes to a
//! frame that decodes to the same message, and nothing panics.

use kvferry_store::internal::proto::{self, Reply, Request};

/// What a frame decoded to.
#[derive(Debug)]
pub(super) enum Decoded {
    /// An engine's request.
    Request(Request),
    /// A server's reply.
    Reply(Reply),
}

/// Decodes `bytes` as one frame; panics on a broken property.
pub(super) fn check_frame(bytes: &[u8]) -> Option<Decoded> {
    let len = proto::decode_header(bytes).ok()? as usize;
    let body = bytes.get(proto::HEADER_LEN..proto::HEADER_LEN + len)?;
    if let Ok((id, req)) = proto::decode_request(body) {
        let again = proto::encode(id, &req).expect("a decoded request encodes");
        let back = proto::decode_request(&again[proto::HEADER_LEN..]).expect("and decodes");
        assert_eq!(back, (id, req.clone()), "request round trip");
        return Some(Decoded::Request(req));
    }
    if let Ok((id, reply)) = proto::decode_reply(body) {
        let again = proto::encode(id, &reply).expect("a decoded reply encodes");
        let back = proto::decode_reply(&again[proto::HEADER_LEN..]).expect("and decodes");
        assert_eq!(back, (id, reply.clone()), "reply round trip");
        return Some(Decoded::Reply(reply));
    }
    None
}
