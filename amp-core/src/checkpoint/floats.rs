//! Serde helpers for float fields that may hold NaN or ±inf.
//!
//! JSON has no number for NaN or infinity, and serde_json writes them as `null`, which does
//! not read back as a float: a checkpoint whose optimizer state held an infinite second moment
//! saved without complaint and could never be loaded. Fields serialised through this module
//! write finite values as plain JSON numbers, exactly as before (so existing files and other
//! readers see the same layout), and non-finite ones as strings that read back to the same
//! bits:
//!
//! - `"inf"` and `"-inf"`;
//! - `"NaN"` for the quiet NaN Rust's `f32::NAN`/`f64::NAN` have, `"-NaN"` for it with the
//!   sign bit set (what x86 produces for `inf - inf` or `0 * inf`);
//! - `"NaN:0x7fc00001"` for any other NaN: its bit pattern, 8 hex digits for an f32, 16 for
//!   an f64.
//!
//! Reading also accepts JSON numbers (integers too), `"infinity"`/`"Infinity"` with either
//! sign, and the spellings above in any case. A JSON `null` where a float was expected is
//! refused with a message saying what it was: a non-finite value saved by a version before
//! this one, which cannot be recovered. Formats that are not human readable (bincode) store
//! floats natively and are passed straight through.
//!
//! Use it on any float field of your own that a checkpoint holds (`f32`, `f64`, and `Vec`s
//! and `Option`s of them, nested); an `Option` field also needs `default` so a missing field
//! still reads as `None`:
//!
//! ```
//! # extern crate amp_core as amp;
//! #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
//! struct Metrics {
//!     #[serde(with = "amp::checkpoint::floats")]
//!     losses: Vec<f64>,
//!     #[serde(with = "amp::checkpoint::floats", default)]
//!     best: Option<f32>,
//! }
//! let m = Metrics { losses: vec![2.5, f64::INFINITY, f64::NAN], best: Some(f32::NEG_INFINITY) };
//! let json = serde_json::to_string(&m).unwrap();
//! assert_eq!(json, r#"{"losses":[2.5,"inf","NaN"],"best":"-inf"}"#);
//! let back: Metrics = serde_json::from_str(&json).unwrap();
//! assert_eq!(back.losses[..2], m.losses[..2]);
//! assert_eq!(back.losses[2].to_bits(), f64::NAN.to_bits());
//! ```
//!
//! [`save_checkpoint`](super::save_checkpoint) refuses a state that still holds a non-finite
//! float outside such a field (it would be written as `null`), naming the field.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde::ser::{self, Serialize, Serializer};

/// A value this module serialises: `f32`, `f64`, and `Vec`s and `Option`s of such values.
pub trait Floats: Sized {
    /// Writes the value, finite floats as numbers and non-finite ones as strings.
    fn serialize_floats<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error>;
    /// Reads what [`Floats::serialize_floats`] wrote (or plain numbers).
    fn deserialize_floats<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error>;
}

/// `#[serde(with = "amp::checkpoint::floats")]`: serialises `value` (see the module).
pub fn serialize<T: Floats, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    value.serialize_floats(serializer)
}

/// `#[serde(with = "amp::checkpoint::floats")]`: deserialises a value (see the module).
pub fn deserialize<'de, T: Floats, D: Deserializer<'de>>(deserializer: D) -> Result<T, D::Error> {
    T::deserialize_floats(deserializer)
}

/// What a JSON `null` in a float's place means, in the error that refuses it.
pub(crate) const NULL_FLOAT: &str = "null where a float was expected: checkpoints written before NaN and \
                                     ±inf were saved as strings hold null for them, and the value cannot be \
                                     recovered";

/// A [`Floats`] value as a `Serialize` (an element of a sequence).
struct Ser<'a, T>(&'a T);

impl<T: Floats> Serialize for Ser<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize_floats(serializer)
    }
}

/// A [`Floats`] value as a `Deserialize`.
struct De<T>(T);

impl<'de, T: Floats> Deserialize<'de> for De<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize_floats(deserializer).map(De)
    }
}

impl<T: Floats> Floats for Vec<T> {
    fn serialize_floats<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter().map(Ser))
    }
    fn deserialize_floats<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Vec::<De<T>>::deserialize(deserializer)?.into_iter().map(|De(v)| v).collect())
    }
}

impl<T: Floats> Floats for Option<T> {
    fn serialize_floats<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Some(v) => serializer.serialize_some(&Ser(v)),
            None => serializer.serialize_none(),
        }
    }
    fn deserialize_floats<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Option::<De<T>>::deserialize(deserializer)?.map(|De(v)| v))
    }
}

/// The non-finite spelling of a float, and reading it back.
trait Float: Copy {
    const NAME: &'static str;
    const HEX_DIGITS: usize;
    const INFINITY: Self;
    const NAN: Self;
    fn bits(self) -> u64;
    fn from_bits(bits: u64) -> Self;
    fn is_nan(self) -> bool;
    fn neg(self) -> Self;
    fn from_f64(v: f64) -> Self;
}

macro_rules! float {
    ($t:ident, $bits:ty, $digits:expr) => {
        impl Float for $t {
            const NAME: &'static str = stringify!($t);
            const HEX_DIGITS: usize = $digits;
            const INFINITY: Self = $t::INFINITY;
            const NAN: Self = $t::NAN;
            fn bits(self) -> u64 {
                self.to_bits() as u64
            }
            fn from_bits(bits: u64) -> Self {
                $t::from_bits(bits as $bits)
            }
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
            fn neg(self) -> Self {
                -self
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }

        impl Floats for $t {
            fn serialize_floats<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                if self.is_finite() || !serializer.is_human_readable() {
                    return self.serialize(serializer);
                }
                serializer.serialize_str(&spell(*self))
            }
            fn deserialize_floats<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                if !deserializer.is_human_readable() {
                    return $t::deserialize(deserializer);
                }
                deserializer.deserialize_any(FloatVisitor::<$t>(PhantomData))
            }
        }
    };
}
float!(f32, u32, 8);
float!(f64, u64, 16);

/// How a non-finite `v` is written (see the module).
fn spell<F: Float>(v: F) -> String {
    if !v.is_nan() {
        return if v.bits() == F::INFINITY.bits() { "inf".into() } else { "-inf".into() };
    }
    if v.bits() == F::NAN.bits() {
        "NaN".into()
    } else if v.bits() == F::NAN.neg().bits() {
        "-NaN".into()
    } else {
        format!("NaN:0x{:0width$x}", v.bits(), width = F::HEX_DIGITS)
    }
}

/// The value a non-finite spelling stands for, or `None` for any other text.
fn parse<F: Float>(s: &str) -> Option<F> {
    let lower = s.to_ascii_lowercase();
    if let Some(hex) = lower.strip_prefix("nan:0x") {
        let bits = u64::from_str_radix(hex, 16).ok().filter(|_| hex.len() == F::HEX_DIGITS)?;
        return Some(F::from_bits(bits)).filter(|v| v.is_nan());
    }
    let (negative, rest) = match lower.as_bytes().first() {
        Some(b'-') => (true, &lower[1..]),
        Some(b'+') => (false, &lower[1..]),
        _ => (false, &lower[..]),
    };
    let v = match rest {
        "inf" | "infinity" => F::INFINITY,
        "nan" => F::NAN,
        _ => return None,
    };
    Some(if negative { v.neg() } else { v })
}

struct FloatVisitor<F>(PhantomData<F>);

impl<F: Float> Visitor<'_> for FloatVisitor<F> {
    type Value = F;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an {} (a number, or \"NaN\", \"inf\" or \"-inf\")", F::NAME)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<F, E> {
        Ok(F::from_f64(v))
    }
    fn visit_f32<E: de::Error>(self, v: f32) -> Result<F, E> {
        Ok(F::from_f64(v as f64))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<F, E> {
        Ok(F::from_f64(v as f64))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<F, E> {
        Ok(F::from_f64(v as f64))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<F, E> {
        parse(s).ok_or_else(|| E::invalid_value(de::Unexpected::Str(s), &self))
    }
    fn visit_unit<E: de::Error>(self) -> Result<F, E> {
        Err(E::custom(NULL_FLOAT))
    }
    fn visit_none<E: de::Error>(self) -> Result<F, E> {
        Err(E::custom(NULL_FLOAT))
    }
}

// ---- finding a non-finite float that would be written as null ------------------------------

/// Where `value` holds a float that serde_json would write as `null` (a NaN or ±inf not
/// serialised through this module): the path to it (`extra.losses[2]`, map keys as
/// `["name"]`) and the value. `None` when there is none, or when `value`'s own `Serialize`
/// fails (serialising it for real reports that).
pub(crate) fn find_non_finite<T: Serialize + ?Sized>(value: &T) -> Option<(String, f64)> {
    match value.serialize(Finder) {
        Err(Found::NonFinite { path, value }) => {
            let mut out = String::new();
            for part in path.iter().rev() {
                if !out.is_empty() && !part.starts_with('[') {
                    out.push('.');
                }
                out.push_str(part);
            }
            Some((out, value))
        }
        _ => None,
    }
}

/// Why the search stopped.
#[derive(Debug)]
enum Found {
    /// A non-finite float; the path is innermost part first (it is built while unwinding).
    NonFinite { path: Vec<String>, value: f64 },
    /// The value's own `Serialize` failed.
    Other(String),
}

impl Found {
    fn at(self, part: impl FnOnce() -> String) -> Found {
        match self {
            Found::NonFinite { mut path, value } => {
                path.push(part());
                Found::NonFinite { path, value }
            }
            other => other,
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::NonFinite { value, .. } => write!(f, "non-finite float {value}"),
            Found::Other(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Found {}

impl ser::Error for Found {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Found::Other(msg.to_string())
    }
}

/// A map key as a path part.
fn key_part<K: Serialize + ?Sized>(key: &K) -> String {
    match serde_json::to_value(key) {
        Ok(serde_json::Value::String(s)) => format!("[{s:?}]"),
        Ok(v) => format!("[{v}]"),
        Err(_) => "[?]".into(),
    }
}

/// A serializer that writes nothing and stops at the first non-finite float.
struct Finder;

/// Sequences and tuples: the index of the next element.
struct Seq(usize);
/// Maps: the last key seen by `serialize_key`.
struct Map(String);

impl Serializer for Finder {
    type Ok = ();
    type Error = Found;
    type SerializeSeq = Seq;
    type SerializeTuple = Seq;
    type SerializeTupleStruct = Seq;
    type SerializeTupleVariant = Seq;
    type SerializeMap = Map;
    type SerializeStruct = Finder;
    type SerializeStructVariant = Finder;

    fn serialize_f32(self, v: f32) -> Result<(), Found> {
        self.serialize_f64(v as f64)
    }
    fn serialize_f64(self, v: f64) -> Result<(), Found> {
        if v.is_finite() { Ok(()) } else { Err(Found::NonFinite { path: Vec::new(), value: v }) }
    }
    fn serialize_bool(self, _: bool) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_char(self, _: char) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Found> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<(), Found> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Found> {
        value.serialize(self).map_err(|e| e.at(|| variant.to_string()))
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Seq, Found> {
        Ok(Seq(0))
    }
    fn serialize_tuple(self, _: usize) -> Result<Seq, Found> {
        Ok(Seq(0))
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Seq, Found> {
        Ok(Seq(0))
    }
    fn serialize_tuple_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Seq, Found> {
        Ok(Seq(0))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Map, Found> {
        Ok(Map(String::new()))
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Finder, Found> {
        Ok(Finder)
    }
    fn serialize_struct_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Finder, Found> {
        Ok(Finder)
    }
}

impl Seq {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
        let i = self.0;
        self.0 += 1;
        value.serialize(Finder).map_err(|e| e.at(|| format!("[{i}]")))
    }
}

macro_rules! seq {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Seq {
            type Ok = ();
            type Error = Found;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
                self.element(value)
            }
            fn end(self) -> Result<(), Found> {
                Ok(())
            }
        }
    )*};
}
seq!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for Map {
    type Ok = ();
    type Error = Found;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Found> {
        self.0 = key_part(key);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
        value.serialize(Finder).map_err(|e| e.at(|| std::mem::take(&mut self.0)))
    }
    // The key is only turned into text when its value holds a non-finite float.
    fn serialize_entry<K: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<(), Found> {
        value.serialize(Finder).map_err(|e| e.at(|| key_part(key)))
    }
    fn end(self) -> Result<(), Found> {
        Ok(())
    }
}

macro_rules! fields {
    ($($trait:ident),*) => {$(
        impl ser::$trait for Finder {
            type Ok = ();
            type Error = Found;
            fn serialize_field<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) -> Result<(), Found> {
                value.serialize(Finder).map_err(|e| e.at(|| name.to_string()))
            }
            fn end(self) -> Result<(), Found> {
                Ok(())
            }
        }
    )*};
}
fields!(SerializeStruct, SerializeStructVariant);

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: Floats>(v: &T) -> (String, T) {
        let json = serde_json::to_string(&Ser(v)).unwrap();
        let back: De<T> = serde_json::from_str(&json).unwrap();
        // Through a `serde_json::Value` too, as checkpoints are read.
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let again: De<T> = serde_json::from_value(value).unwrap();
        assert_eq!(serde_json::to_string(&Ser(&again.0)).unwrap(), json);
        (json, back.0)
    }

    #[test]
    fn non_finite_values_round_trip_bit_for_bit() {
        let nan_payload = f32::from_bits(0x7fc0_0001);
        let negative_nan = f32::from_bits(0xffc0_0000);
        let v = vec![1.5f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, negative_nan, nan_payload, 3e-45];
        let (json, back) = round_trip(&v);
        assert_eq!(json, r#"[1.5,-0.0,"inf","-inf","NaN","-NaN","NaN:0x7fc00001",3e-45]"#);
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );

        let signalling = f64::from_bits(0x7ff0_0000_0000_0001);
        let v = vec![Some(0.1f64), None, Some(f64::NAN), Some(signalling), Some(f64::NEG_INFINITY)];
        let (json, back) = round_trip(&v);
        assert_eq!(json, r#"[0.1,null,"NaN","NaN:0x7ff0000000000001","-inf"]"#);
        let bits = |v: &[Option<f64>]| v.iter().map(|x| x.map(f64::to_bits)).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&v));
    }

    #[test]
    fn finite_values_are_written_as_serde_json_writes_them() {
        let v: Vec<f32> = vec![0.1, 1e-10, 65536.0, f32::MAX, f32::MIN_POSITIVE, -3.25];
        assert_eq!(serde_json::to_string(&Ser(&v)).unwrap(), serde_json::to_string(&v).unwrap());
        let v: Vec<f64> = vec![0.1, 1e300, 2.0];
        assert_eq!(serde_json::to_string(&Ser(&v)).unwrap(), serde_json::to_string(&v).unwrap());
        // Integers and other spellings read; other text and null are refused, null saying why.
        let back: De<Vec<f32>> = serde_json::from_str(r#"[0, -2, "Infinity", "-INF", "nan", "+inf"]"#).unwrap();
        assert_eq!(back.0[..2], [0.0, -2.0]);
        assert_eq!((back.0[2], back.0[3], back.0[5]), (f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY));
        assert!(back.0[4].is_nan());
        for bad in [r#""1.5""#, r#""NaN:0x7ff0000000000001""#, r#""NaN:0x3f800000""#, "true"] {
            assert!(serde_json::from_str::<De<f32>>(bad).is_err(), "{bad}");
        }
        let err = serde_json::from_str::<De<Vec<f32>>>("[1.0, null]").err().unwrap().to_string();
        assert!(err.contains(NULL_FLOAT), "{err}");
    }

    #[test]
    fn finds_the_path_to_a_non_finite_float() {
        #[derive(serde::Serialize)]
        struct Inner {
            ok: Vec<f32>,
            values: std::collections::BTreeMap<String, Vec<f64>>,
        }
        #[derive(serde::Serialize)]
        struct Outer {
            name: &'static str,
            inner: Option<Inner>,
            #[serde(with = "super")]
            handled: f32,
        }
        let mut values = std::collections::BTreeMap::new();
        values.insert("a.b".to_string(), vec![1.0, 2.0]);
        let mut outer =
            Outer { name: "x", inner: Some(Inner { ok: vec![1.0], values: values.clone() }), handled: f32::NAN };
        assert_eq!(find_non_finite(&outer), None, "a field serialised through this module is fine");
        values.insert("c".to_string(), vec![1.0, 2.0, f64::NEG_INFINITY]);
        outer.inner = Some(Inner { ok: vec![1.0], values });
        assert_eq!(find_non_finite(&outer), Some((r#"inner.values["c"][2]"#.to_string(), f64::NEG_INFINITY)));
        assert_eq!(find_non_finite(&serde_json::json!({"a": [1.0]})), None);
        assert_eq!(find_non_finite(&[0.5f32, f32::NAN]).map(|(p, _)| p), Some("[1]".to_string()));
    }
}
