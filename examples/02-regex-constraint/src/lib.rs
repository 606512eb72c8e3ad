//! An example third-party constraint plugin, written only against `deepinfer-plugin-sdk`: the
//! output must fully match a regular expression (kind `regex`).
//!
//! `compile` builds regex-automata's dense DFA of the pattern (anchored at the start, all
//! matches kept), finds its live states (those from which some continuation ends in a match;
//! the DFA reports matches one byte late, so "not dead" is not enough), and then precomputes,
//! for every DFA state a token can reach from the start, the bitset of tokens allowed there:
//! a token is allowed if walking its bytes ends in a live state; end-of-sequence is allowed
//! where the end of input matches. Tokens are walked in
//! sorted byte order so that a shared prefix is walked once per state. A matcher is then a
//! stack of DFA states: `mask` copies one precomputed bitset, `consume` walks the token's
//! bytes, `rollback` pops.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use deepinfer_plugin_sdk::constraint::{Constraint, Matcher, Vocabulary};
use deepinfer_plugin_sdk::{Settings, TokenId};
use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

/// Setting: most DFA states the index may hold (default 4096).
const MAX_STATES: &str = "max-states";
/// Bytes the DFA may take while it is built (and once built).
const DFA_SIZE_LIMIT: usize = 32 << 20;

/// The vocabulary in the order the index walks it.
#[derive(Default)]
struct Tokens {
    vocab: Vocabulary,
    /// Token ids sorted by their bytes (special, EOS and empty tokens left out).
    sorted: Vec<TokenId>,
    /// For `sorted[k]`: bytes it shares with `sorted[k - 1]`.
    lcp: Vec<u32>,
}

/// The plugin's per-instance state.
pub struct RegexPlugin {
    tokens: Rc<Tokens>,
    max_states: usize,
}

impl Default for RegexPlugin {
    fn default() -> Self {
        RegexPlugin {
            tokens: Rc::default(),
            max_states: 4096,
        }
    }
}

/// What is known at one DFA state.
struct Entry {
    mask: Vec<u32>,
    accepting: bool,
    /// Some non-EOS token is allowed.
    can_continue: bool,
}

/// A compiled regex: its DFA and the state-to-allowed-tokens index.
pub struct RegexGrammar {
    index: Rc<Index>,
}

struct Index {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    /// States from which some continuation of bytes ends in a match at the end of input.
    live: HashSet<StateID>,
    entries: HashMap<StateID, Entry>,
    tokens: Rc<Tokens>,
}

/// One sequence: the DFA state after each consumed token (`None` after end-of-sequence).
pub struct RegexMatcher {
    index: Rc<Index>,
    states: Vec<Option<StateID>>,
}

impl RegexPlugin {
    /// The plugin ready for `compile` (native use: tests).
    pub fn with_vocabulary(vocab: Vocabulary) -> Result<Self, String> {
        let mut p = RegexPlugin::default();
        p.init(vocab)?;
        Ok(p)
    }
}

impl Constraint for RegexPlugin {
    type Grammar = RegexGrammar;
    type Matcher = RegexMatcher;
    const DESCRIPTION: &'static str = "regexes through a dense DFA with a state-to-tokens index";
    const KINDS: &'static [&'static str] = &["regex"];

    fn configure(&mut self, settings: &Settings) -> Result<(), String> {
        settings.reject_unknown(&[MAX_STATES])?;
        self.max_states = settings.parse_or(MAX_STATES, 4096usize)?;
        Ok(())
    }

    fn init(&mut self, vocab: Vocabulary) -> Result<(), String> {
        vocab.check()?;
        let excluded: Vec<TokenId> = vocab
            .special_tokens
            .iter()
            .chain(&vocab.eos_tokens)
            .copied()
            .collect();
        let mut sorted: Vec<TokenId> = (0..vocab.len() as TokenId)
            .filter(|t| !excluded.contains(t) && !vocab.token(*t).is_empty())
            .collect();
        sorted.sort_by(|&a, &b| vocab.token(a).cmp(vocab.token(b)));
        let mut lcp = Vec::with_capacity(sorted.len());
        let mut prev: &[u8] = &[];
        for &t in &sorted {
            let b = vocab.token(t);
            lcp.push(b.iter().zip(prev).take_while(|(x, y)| x == y).count() as u32);
            prev = b;
        }
        self.tokens = Rc::new(Tokens { vocab, sorted, lcp });
        Ok(())
    }

    fn compile(&mut self, kind: &str, spec: &str) -> Result<RegexGrammar, String> {
        if kind != "regex" {
            return Err(format!(
                "unknown constraint kind `{kind}` (this plugin compiles `regex`)"
            ));
        }
        let dfa = dense::Builder::new()
            .configure(
                dense::DFA::config()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(DFA_SIZE_LIMIT))
                    .determinize_size_limit(Some(DFA_SIZE_LIMIT)),
            )
            .build(spec)
            .map_err(|e| format!("regex: {}", chain(&e)))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| format!("regex: {}", chain(&e)))?;
        let live = live_states(&dfa, start, self.max_states)?;
        let mut index = Index {
            dfa,
            start,
            live,
            entries: HashMap::new(),
            tokens: self.tokens.clone(),
        };
        // Every state a token sequence can reach from the start, breadth first.
        let mut queue = vec![start];
        while let Some(s) = queue.pop() {
            if index.entries.contains_key(&s) {
                continue;
            }
            if index.entries.len() >= self.max_states {
                return Err(format!(
                    "regex: more than {} DFA states are reachable (setting `{MAX_STATES}`)",
                    self.max_states
                ));
            }
            let (entry, ends) = index.walk(s);
            index.entries.insert(s, entry);
            queue.extend(ends.into_iter().filter(|e| !index.entries.contains_key(e)));
        }
        Ok(RegexGrammar {
            index: Rc::new(index),
        })
    }

    fn matcher(&mut self, grammar: &RegexGrammar) -> RegexMatcher {
        RegexMatcher {
            index: grammar.index.clone(),
            states: vec![Some(grammar.index.start)],
        }
    }
}

/// An error with its sources, joined by ": " (regex-automata puts the parser's message, with
/// the position, in the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// The live states among those reachable from `start` over any bytes: a state is live if the
/// end of input matches there, or some byte leads to a live state.
fn live_states(
    dfa: &dense::DFA<Vec<u32>>,
    start: StateID,
    max_states: usize,
) -> Result<HashSet<StateID>, String> {
    let mut seen = HashSet::from([start]);
    let mut order = vec![start];
    let mut preds: HashMap<StateID, Vec<StateID>> = HashMap::new();
    let mut i = 0;
    while let Some(&s) = order.get(i) {
        i += 1;
        if dfa.is_dead_state(s) {
            continue;
        }
        for b in 0..=255u8 {
            let n = dfa.next_state(s, b);
            preds.entry(n).or_default().push(s);
            if seen.insert(n) {
                if seen.len() > max_states {
                    return Err(format!(
                        "regex: the DFA has more than {max_states} states (setting `{MAX_STATES}`)"
                    ));
                }
                order.push(n);
            }
        }
    }
    let mut live: HashSet<StateID> = order
        .iter()
        .copied()
        .filter(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
        .collect();
    let mut stack: Vec<StateID> = live.iter().copied().collect();
    while let Some(s) = stack.pop() {
        for &p in preds.get(&s).into_iter().flatten() {
            if live.insert(p) {
                stack.push(p);
            }
        }
    }
    Ok(live)
}

impl Index {
    /// The entry of state `s` and the distinct states its allowed tokens lead to.
    fn walk(&self, s: StateID) -> (Entry, Vec<StateID>) {
        let tokens = &self.tokens;
        let v = &tokens.vocab;
        let mut mask = vec![0u32; v.mask_words()];
        let mut ends = Vec::new();
        // stack[d]: the state after the first d bytes of the current token.
        let mut stack = vec![s];
        let mut can_continue = false;
        for (k, &t) in tokens.sorted.iter().enumerate() {
            let bytes = v.token(t);
            stack.truncate(tokens.lcp[k] as usize + 1);
            let mut cur = *stack.last().unwrap_or(&s);
            for &b in &bytes[stack.len() - 1..] {
                if self.live.contains(&cur) {
                    cur = self.dfa.next_state(cur, b);
                }
                stack.push(cur);
            }
            if self.live.contains(&cur) {
                mask[t as usize / 32] |= 1 << (t % 32);
                can_continue = true;
                ends.push(cur);
            }
        }
        let accepting = self.accepting(s);
        if accepting {
            for &e in &v.eos_tokens {
                if let Some(w) = mask.get_mut(e as usize / 32) {
                    *w |= 1 << (e % 32);
                }
            }
        }
        ends.sort_unstable();
        ends.dedup();
        let entry = Entry {
            mask,
            accepting,
            can_continue,
        };
        (entry, ends)
    }

    fn accepting(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }

    /// The state after token `t` from `s`, if `t` is allowed there.
    fn step(&self, s: StateID, t: TokenId) -> Option<StateID> {
        let entry = self.entries.get(&s)?;
        if entry.mask.get(t as usize / 32)? >> (t % 32) & 1 == 0 {
            return None;
        }
        let mut cur = s;
        for &b in self.tokens.vocab.token(t) {
            cur = self.dfa.next_state(cur, b);
        }
        Some(cur)
    }

    fn is_eos(&self, t: TokenId) -> bool {
        self.tokens.vocab.eos_tokens.contains(&t)
    }
}

impl RegexMatcher {
    /// The state after `t` from `state`: `Some(None)` after an allowed end-of-sequence.
    fn next(&self, state: Option<StateID>, t: TokenId) -> Option<Option<StateID>> {
        let s = state?;
        if self.index.is_eos(t) {
            return self.index.accepting(s).then_some(None);
        }
        self.index.step(s, t).map(Some)
    }
}

impl Matcher for RegexMatcher {
    fn mask(&mut self, out: &mut Vec<u32>) -> Result<(), String> {
        let words = self.index.tokens.vocab.mask_words();
        match self.states.last().copied().flatten() {
            Some(s) => {
                let entry = self
                    .index
                    .entries
                    .get(&s)
                    .ok_or("internal: a reachable state is missing from the index")?;
                out.extend_from_slice(&entry.mask);
            }
            None => out.resize(out.len() + words, 0),
        }
        Ok(())
    }

    fn consume(&mut self, tokens: &[TokenId]) -> Result<(), String> {
        for (i, &t) in tokens.iter().enumerate() {
            let cur = self.states.last().copied().flatten();
            match self.next(cur, t) {
                Some(next) => self.states.push(next),
                None => {
                    return Err(format!(
                        "token {t} is not allowed here (after {i} of {})",
                        tokens.len()
                    ))
                }
            }
        }
        Ok(())
    }

    fn rollback(&mut self, n: u32) -> Result<(), String> {
        let n = n as usize;
        if n >= self.states.len() {
            return Err(format!(
                "cannot roll back {n} tokens: only {} were consumed",
                self.states.len() - 1
            ));
        }
        self.states.truncate(self.states.len() - n);
        Ok(())
    }

    fn validate(&mut self, tokens: &[TokenId]) -> u32 {
        let mut cur = self.states.last().copied().flatten();
        let mut n = 0;
        for &t in tokens {
            match self.next(cur, t) {
                Some(next) => cur = next,
                None => break,
            }
            n += 1;
            if cur.is_none() {
                break;
            }
        }
        n
    }

    fn is_accepting(&mut self) -> bool {
        match self.states.last().copied().flatten() {
            Some(s) => self.index.accepting(s),
            None => true,
        }
    }

    fn is_finished(&mut self) -> bool {
        match self.states.last().copied().flatten() {
            Some(s) => self
                .index
                .entries
                .get(&s)
                .is_some_and(|e| e.accepting && !e.can_continue),
            None => true,
        }
    }
}

deepinfer_plugin_sdk::export_constraint!(RegexPlugin);

#[cfg(test)]
mod tests;
