//! What a handler sees of a request ([`Request`]), what it answers
//! ([`Reply`]), and the answers the server gives itself ([`Refusal`]).

use std::net::SocketAddr;

/// One request, its body read.
pub struct Request<'a> {
    raw: &'a tiny_http::Request,
    body: &'a [u8],
}

impl<'a> Request<'a> {
    pub(crate) fn new(raw: &'a tiny_http::Request, body: &'a [u8]) -> Request<'a> {
        Request { raw, body }
    }

    /// The method as sent (`"GET"`, `"POST"`...).
    pub fn method(&self) -> &str {
        self.raw.method().as_str()
    }

    /// The request target as sent: the path and the query, what a
    /// signature covers.
    pub fn url(&self) -> &str {
        self.raw.url()
    }

    /// The target's path (before any `?`).
    pub fn path(&self) -> &str {
        self.split().0
    }

    /// The target's query (after the first `?`; empty without one).
    pub fn query(&self) -> &str {
        self.split().1
    }

    fn split(&self) -> (&str, &str) {
        let url = self.url();
        url.split_once('?').unwrap_or((url, ""))
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        self.body
    }

    /// The caller's address.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.raw.remote_addr().copied()
    }

    /// The value of the header `name` (case-insensitive), if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.raw
            .headers()
            .iter()
            .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
            .map(|h| h.value.as_str())
    }
}

/// An answer: a status, a content type, a body, and any further headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The HTTP status code.
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
    headers: Vec<(&'static str, String)>,
}

impl Reply {
    /// `body` of `content_type` with `status`.
    pub fn new(status: u16, content_type: &'static str, body: String) -> Reply {
        Reply {
            status,
            content_type,
            body,
            headers: Vec::new(),
        }
    }

    /// The reply with the header `name: value` too.
    pub fn with_header(mut self, name: &'static str, value: String) -> Reply {
        self.headers.push((name, value));
        self
    }

    pub(crate) fn into_response(self) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
        let mut response = tiny_http::Response::from_string(self.body)
            .with_status_code(tiny_http::StatusCode(self.status))
            .with_header(header("Content-Type", self.content_type));
        for (name, value) in &self.headers {
            response.add_header(header(name, value));
        }
        response
    }
}

/// A header of a reply. Names are the server's own; values are ASCII
/// (content types, method lists), so building one cannot fail.
fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes())
        .expect("reply headers are ASCII")
}

/// A request the server answers itself, before or instead of a handler;
/// each server words these its own way ([`crate::Config::refusal`]).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// No route has this path (404).
    #[error("no route {path}")]
    NotFound {
        /// The path asked for.
        path: String,
    },
    /// Routes have this path, none this method (405, with an `Allow`
    /// header naming theirs).
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed {
        /// The method asked for.
        method: String,
        /// The path asked for.
        path: String,
        /// The methods the path's routes take.
        allow: Vec<crate::Method>,
    },
    /// The body is longer than the server takes (413).
    #[error("body larger than {max} bytes")]
    BodyTooLarge {
        /// The most the server takes.
        max: usize,
    },
    /// The body could not be read (400).
    #[error("cannot read body: {0}")]
    BadBody(#[source] std::io::Error),
    /// The route wants a signed request and the server has no [`crate::Gate`]
    /// to check it (401: a missing check refuses, never lets through).
    #[error("unauthorized")]
    Unauthorized,
    /// The handler panicked (500); the server goes on serving.
    #[error("internal error")]
    Internal,
}

impl Refusal {
    /// The `Allow` header of a 405: the methods the path takes.
    pub fn allow(&self) -> Option<String> {
        let Refusal::MethodNotAllowed { allow, .. } = self else {
            return None;
        };
        let names: Vec<&str> = allow.iter().map(|m| m.as_str()).collect();
        Some(names.join(", "))
    }

    /// The HTTP status code it answers with.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::NotFound { .. } => 404,
            Refusal::MethodNotAllowed { .. } => 405,
            Refusal::BodyTooLarge { .. } => 413,
            Refusal::BadBody(_) => 400,
            Refusal::Unauthorized => 401,
            Refusal::Internal => 500,
        }
    }
}
