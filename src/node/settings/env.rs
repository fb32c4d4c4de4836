//! How a `KVFERRY_<KEY>` variable's text becomes its key's JSON value: by
//! the key's type, so a key's declaration says it once.

/// How an environment variable's text becomes a key's JSON value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Taken as it is (names, addresses, enum values).
    Text,
    /// A non-negative integer.
    Number,
    /// `1`/`true` or `0`/`false`.
    Flag,
}

impl Kind {
    /// The JSON value of `text`, or `None` if it is not of this kind.
    pub(super) fn parse(self, text: &str) -> Option<serde_json::Value> {
        match self {
            Kind::Text => Some(serde_json::Value::String(text.to_string())),
            Kind::Number => text.trim().parse::<u64>().ok().map(Into::into),
            Kind::Flag => match text.trim() {
                "1" | "true" => Some(true.into()),
                "0" | "false" => Some(false.into()),
                _ => None,
            },
        }
    }

    /// What a value of this kind is, for an error message.
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Text => "text",
            Kind::Number => "a non-negative integer",
            Kind::Flag => "true/false or 1/0",
        }
    }
}

/// The [`Kind`] of a setting's type.
pub(super) trait EnvKind {
    /// How the type reads from an environment variable.
    const KIND: Kind;
}

macro_rules! env_kind {
    ($kind:ident: $($ty:ty),+) => {
        $(impl EnvKind for $ty {
            const KIND: Kind = Kind::$kind;
        })+
    };
}

env_kind!(Text: String);
env_kind!(Number: u16, u32, u64, usize);
env_kind!(Flag: bool);
