//! The line index: the 1-based line of every key, from a marked pass over libyaml's events
//! (serde_yaml's `Value` has no spans), and the refusals that keep serde_yaml fast.

use std::collections::HashMap;

use super::{Lines, Seg};

// ---------------------------------------------------------------------------------------------
// The line index: a marked pass over libyaml's events
// ---------------------------------------------------------------------------------------------

/// Deeper keys are not indexed: only the first levels are ever reported, and this bounds the
/// work of cloning paths.
pub(super) const MAX_INDEXED_DEPTH: usize = 16;
/// serde_yaml's nesting limit (its `recursion limit exceeded`).
pub(super) const MAX_NESTING: usize = 128;
/// The most nodes that aliases may add by expansion (a real configuration reuses a few small
/// anchors). serde_yaml bounds the number of alias jumps, not what they copy, so an anchor of n
/// items used n times cost n² values (14 KB of YAML: 4 million values, 1.3 s; 140 KB: out of
/// memory), and 70 000 values before its own limit took 35 ms.
pub(super) const MAX_ALIAS_NODES: u64 = 10_000;

/// What the marked pass finds.
pub(super) struct Index {
    pub(super) lines: Lines,
    /// Each key written twice in one mapping: (path, first line, repeated line), in order.
    pub(super) duplicates: Vec<(Vec<Seg>, usize, usize)>,
    /// Why the YAML is refused before serde_yaml reads it, and where (the pass stops there).
    pub(super) refused: Option<(usize, String)>,
}

impl Lines {
    /// The 1-based line of every mapping key (scalar keys) and sequence item down to
    /// [`MAX_INDEXED_DEPTH`], paths prefixed with `base`; repeated keys; and a refusal at the
    /// first nesting beyond [`MAX_NESTING`] or alias expansion beyond [`MAX_ALIAS_NODES`].
    /// Stops quietly at a syntax error (the caller has the error from serde_yaml).
    pub(super) fn index(text: &str, base: Vec<Seg>) -> Index {
        use events::Event;

        enum State {
            Key,
            Value(Option<String>),
            Item(usize),
        }
        struct Frame {
            state: State,
            pushed: bool,
            recording: bool,
            /// Nodes in this collection with aliases expanded, itself included.
            nodes: u64,
            /// The anchor on this collection and the number of its definition.
            anchor: Option<(Vec<u8>, usize)>,
        }
        /// A node of `nodes` (expanded) nodes ends: its parent moves on and counts it.
        fn close(frames: &mut [Frame], key: Option<String>, nodes: u64) {
            if let Some(frame) = frames.last_mut() {
                frame.nodes = frame.nodes.saturating_add(nodes);
                frame.state = match frame.state {
                    State::Key => State::Value(key),
                    State::Value(_) => State::Key,
                    State::Item(i) => State::Item(i + 1),
                };
            }
        }

        let mut index = Index { lines: Lines::default(), duplicates: Vec::new(), refused: None };
        let Some(events) = events::Events::new(text) else { return index };
        let mut path = base;
        let mut frames: Vec<Frame> = Vec::new();
        // Each anchor's latest definition (defined where its node starts, as serde_yaml's loader
        // does): its number and its expanded size, None while its node is still open.
        let mut anchors: HashMap<Vec<u8>, (usize, Option<u64>)> = HashMap::new();
        let mut definitions = 0usize;
        let mut alias_nodes = 0u64;
        for (event, line) in events {
            let (Event::Scalar(..) | Event::Alias(_) | Event::SequenceStart(_) | Event::MappingStart(_)) =
                event
            else {
                if let Event::SequenceEnd | Event::MappingEnd = event {
                    if let Some(frame) = frames.pop() {
                        if frame.pushed {
                            path.pop();
                        }
                        if let Some((name, number)) = frame.anchor {
                            // Unless an inner node took the name over meanwhile.
                            if let Some((latest, size)) = anchors.get_mut(&name) {
                                if *latest == number {
                                    *size = Some(frame.nodes);
                                }
                            }
                        }
                        close(&mut frames, None, frame.nodes);
                    }
                }
                continue;
            };

            // Where the node sits in its parent, and its line if it is a key or a list item.
            let recording = frames.last().is_none_or(|f| f.recording) && path.len() < MAX_INDEXED_DEPTH;
            let (is_key, seg) = match frames.last().map(|f| &f.state) {
                None => (false, None),
                Some(State::Key) => (true, None),
                Some(State::Value(key)) => (false, key.clone().map(Seg::Key)),
                Some(State::Item(i)) => (false, Some(Seg::Index(*i))),
            };
            let at = match (&event, &seg) {
                (Event::Scalar(key, _), _) if recording && is_key => {
                    Some(path.iter().cloned().chain([Seg::Key(key.clone())]).collect())
                }
                (_, Some(Seg::Index(_))) if recording => {
                    Some(path.iter().cloned().chain(seg.clone()).collect())
                }
                (_, None) if recording && frames.is_empty() && !path.is_empty() => Some(path.clone()),
                _ => None,
            };
            if let Some(at) = at {
                match index.lines.0.get(&at) {
                    Some(&first) => index.duplicates.push((at, first, line)),
                    None => {
                        index.lines.0.insert(at, line);
                    }
                }
            }

            let is_mapping_start = matches!(event, Event::MappingStart(_));
            match event {
                Event::SequenceStart(anchor) | Event::MappingStart(anchor) => {
                    let root = frames.is_empty();
                    let pushed = seg.is_some();
                    path.extend(seg);
                    let state = if is_mapping_start { State::Key } else { State::Item(0) };
                    let anchor = anchor.map(|name| {
                        definitions += 1;
                        anchors.insert(name.clone(), (definitions, None));
                        (name, definitions)
                    });
                    frames.push(Frame {
                        state,
                        pushed,
                        recording: recording && (pushed || root),
                        nodes: 1,
                        anchor,
                    });
                    if frames.len() > MAX_NESTING {
                        index.refused =
                            Some((line, format!("the YAML nests deeper than {MAX_NESTING} levels")));
                        break;
                    }
                }
                Event::Scalar(text, anchor) => {
                    if let Some(name) = anchor {
                        anchors.insert(name, (0, Some(1)));
                    }
                    close(&mut frames, Some(text).filter(|_| is_key), 1);
                }
                Event::Alias(anchor) => {
                    // An unknown anchor is serde_yaml's error to report. An alias inside the
                    // node it names would expand forever: serde_yaml expands it until its
                    // nesting limit, copying everything else in the node at every level.
                    let nodes = match anchors.get(&anchor) {
                        Some((_, Some(nodes))) => *nodes,
                        Some((_, None)) => {
                            let name = String::from_utf8_lossy(&anchor);
                            index.refused =
                                Some((line, format!("the alias *{name} is inside the node it names")));
                            break;
                        }
                        None => 1,
                    };
                    alias_nodes = alias_nodes.saturating_add(nodes);
                    if alias_nodes > MAX_ALIAS_NODES {
                        let message =
                            format!("the YAML's aliases expand to more than {MAX_ALIAS_NODES} nodes");
                        index.refused = Some((line, message));
                        break;
                    }
                    close(&mut frames, None, nodes);
                }
                _ => {}
            }
        }
        index
    }
}

/// A safe iterator over the events of libyaml (`unsafe_libyaml`, the parser serde_yaml uses),
/// with the 1-based line where each starts.
pub(super) mod events {
    use std::ffi::CStr;
    use std::marker::PhantomData;
    use std::mem::MaybeUninit;

    use unsafe_libyaml as unsafe_yaml;

    /// An event; anchors are the names after `&` (on a node) or `*` (an alias).
    pub(super) enum Event {
        Scalar(String, Option<Vec<u8>>),
        Alias(Vec<u8>),
        SequenceStart(Option<Vec<u8>>),
        SequenceEnd,
        MappingStart(Option<Vec<u8>>),
        MappingEnd,
        Other,
    }

    pub(super) struct Events<'a> {
        // Boxed so that the parser never moves once initialised.
        parser: Box<MaybeUninit<unsafe_yaml::yaml_parser_t>>,
        done: bool,
        _input: PhantomData<&'a str>,
    }

    impl<'a> Events<'a> {
        pub(super) fn new(text: &'a str) -> Option<Events<'a>> {
            let mut parser = Box::new(MaybeUninit::<unsafe_yaml::yaml_parser_t>::uninit());
            // SAFETY: `parser` is valid for writes; initialisation zeroes it first. The input
            // outlives the parser (`'a`), which only reads it.
            unsafe {
                if unsafe_yaml::yaml_parser_initialize(parser.as_mut_ptr()).fail {
                    return None;
                }
                unsafe_yaml::yaml_parser_set_encoding(parser.as_mut_ptr(), unsafe_yaml::YAML_UTF8_ENCODING);
                unsafe_yaml::yaml_parser_set_input_string(
                    parser.as_mut_ptr(),
                    text.as_ptr(),
                    text.len() as u64,
                );
            }
            Some(Events { parser, done: false, _input: PhantomData })
        }
    }

    /// A NUL-terminated anchor name owned by an event, or NULL.
    ///
    /// SAFETY: `ptr` is NULL or points to a NUL-terminated string alive for the call.
    unsafe fn anchor(ptr: *const u8) -> Option<Vec<u8>> {
        // SAFETY: as documented by the caller's contract.
        (!ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr.cast()) }.to_bytes().to_vec())
    }

    impl Iterator for Events<'_> {
        type Item = (Event, usize);

        /// The next event and its line; None at the end of the stream or at a syntax error.
        fn next(&mut self) -> Option<(Event, usize)> {
            if self.done {
                return None;
            }
            let mut raw = MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
            // SAFETY: the parser was initialised in `new`; on success `raw` holds an event that
            // we read according to its type (libyaml's strings are NUL-terminated, the scalar
            // value has its length) and then delete exactly once.
            unsafe {
                if unsafe_yaml::yaml_parser_parse(self.parser.as_mut_ptr(), raw.as_mut_ptr()).fail {
                    self.done = true;
                    return None;
                }
                let raw = raw.as_mut_ptr();
                let line = usize::try_from((*raw).start_mark.line).unwrap_or(usize::MAX).saturating_add(1);
                let data = &(*raw).data;
                let event = match (*raw).type_ {
                    unsafe_yaml::YAML_SCALAR_EVENT => {
                        let scalar = data.scalar;
                        let bytes = if scalar.value.is_null() || scalar.length == 0 {
                            &[][..]
                        } else {
                            std::slice::from_raw_parts(scalar.value, scalar.length as usize)
                        };
                        Event::Scalar(String::from_utf8_lossy(bytes).into_owned(), anchor(scalar.anchor))
                    }
                    unsafe_yaml::YAML_ALIAS_EVENT => {
                        Event::Alias(anchor(data.alias.anchor).unwrap_or_default())
                    }
                    unsafe_yaml::YAML_SEQUENCE_START_EVENT => {
                        Event::SequenceStart(anchor(data.sequence_start.anchor))
                    }
                    unsafe_yaml::YAML_SEQUENCE_END_EVENT => Event::SequenceEnd,
                    unsafe_yaml::YAML_MAPPING_START_EVENT => {
                        Event::MappingStart(anchor(data.mapping_start.anchor))
                    }
                    unsafe_yaml::YAML_MAPPING_END_EVENT => Event::MappingEnd,
                    unsafe_yaml::YAML_STREAM_END_EVENT | unsafe_yaml::YAML_NO_EVENT => {
                        self.done = true;
                        Event::Other
                    }
                    _ => Event::Other,
                };
                unsafe_yaml::yaml_event_delete(raw);
                Some((event, line))
            }
        }
    }

    impl Drop for Events<'_> {
        fn drop(&mut self) {
            // SAFETY: initialised in `new` (a failed initialisation returns no `Events`).
            unsafe { unsafe_yaml::yaml_parser_delete(self.parser.as_mut_ptr()) }
        }
    }
}
