//! The one rule every kvferry protocol applies to a postcard message: at
//! most `max` bytes, decoded whole (nothing left over), and a typed reason
//! when not. The control frames ([`super::decode`]), the store server's
//! protocol and the store's lookup messages each map [`EnvelopeError`]
//! onto their own error type.

use serde::{Deserialize, Serialize};

/// Why bytes are not one whole message.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// More bytes than the protocol allows in one message.
    #[error("a message of {len} bytes, at most {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The bytes ended inside the message.
    #[error("the message is cut short")]
    Truncated,
    /// Bytes left after the message.
    #[error("{extra} bytes after the message")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// The bytes are not a message of this shape.
    #[error("malformed message")]
    Malformed,
}

/// Decodes all of `bytes` as one `T`, refusing more than `max` bytes
/// before looking at them.
pub fn decode_whole<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    max: usize,
) -> Result<T, EnvelopeError> {
    if bytes.len() > max {
        return Err(EnvelopeError::TooLarge {
            len: bytes.len(),
            max,
        });
    }
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(EnvelopeError::Trailing { extra: rest.len() }),
        Err(postcard::Error::DeserializeUnexpectedEnd) => Err(EnvelopeError::Truncated),
        Err(_) => Err(EnvelopeError::Malformed),
    }
}

/// `msg`'s bytes appended to `out`, refused when the message alone is
/// longer than `max`.
pub fn encode_into<T: Serialize>(
    msg: &T,
    out: Vec<u8>,
    max: usize,
) -> Result<Vec<u8>, EnvelopeError> {
    let start = out.len();
    let out = postcard::to_extend(msg, out).map_err(|_| EnvelopeError::Malformed)?;
    match out.len() - start {
        len if len > max => Err(EnvelopeError::TooLarge { len, max }),
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_taken_whole_and_within_its_bound() {
        let bytes = encode_into(&(7u16, vec![1u32, 2, 3]), Vec::new(), 64).unwrap();
        let back: (u16, Vec<u32>) = decode_whole(&bytes, 64).unwrap();
        assert_eq!(back, (7, vec![1, 2, 3]));
        let too_long = decode_whole::<(u16, Vec<u32>)>(&bytes, bytes.len() - 1);
        assert_eq!(
            too_long,
            Err(EnvelopeError::TooLarge {
                len: bytes.len(),
                max: bytes.len() - 1
            })
        );
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(
            decode_whole::<(u16, Vec<u32>)>(&extra, 64),
            Err(EnvelopeError::Trailing { extra: 1 })
        );
        assert_eq!(
            decode_whole::<(u16, Vec<u32>)>(&bytes[..bytes.len() - 1], 64),
            Err(EnvelopeError::Truncated)
        );
        assert_eq!(
            encode_into(&vec![0u8; 100], vec![9; 4], 50),
            Err(EnvelopeError::TooLarge { len: 101, max: 50 })
        );
    }
}
