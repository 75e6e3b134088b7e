//! Teacher-forced scoring of a text: perplexity and the arg-max prediction at every
//! position, as llama.cpp's `llama-perplexity` judges a model.

use serde::{Deserialize, Serialize};

use crate::sampling::argmax;
use crate::{Engine, EngineError, Result, Session};

/// The score of a text.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Perplexity {
    /// The text's token ids (with BOS when the model's rule asks for it).
    pub tokens: Vec<u32>,
    /// `top1[i]`: the most likely next token after position `i` (one per token but the last).
    pub top1: Vec<u32>,
    /// `margin[i]`: how far the most likely token's logit is above the second's (a small
    /// margin is a near-tie that another summation order may flip).
    pub margin: Vec<f32>,
    /// Negative log-likelihood of `tokens[i + 1]` after position `i`.
    pub nll: Vec<f32>,
    pub ppl: f64,
}

impl Engine {
    /// Scores `text` in windows of `window` tokens (each window starts with an empty
    /// cache), running at most `chunk` positions per forward pass. `progress` receives
    /// (positions done, positions in all).
    pub fn perplexity(
        &self,
        text: &str,
        window: usize,
        chunk: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Perplexity> {
        self.perplexity_in(&mut self.session(), text, window, chunk, progress)
    }

    /// [`Engine::perplexity`] on a given session (a model split across ranks).
    pub fn perplexity_in(
        &self,
        session: &mut dyn Session,
        text: &str,
        window: usize,
        chunk: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Perplexity> {
        let tokens = self.raw_prompt(text)?;
        if tokens.len() < 2 {
            return Err(EngineError::Invalid(
                "the text must be at least two tokens long to be scored".into(),
            ));
        }
        let window = window.clamp(1, self.context_length());
        let chunk = chunk.max(1);
        let mut top1 = Vec::with_capacity(tokens.len() - 1);
        let mut nll = Vec::with_capacity(tokens.len() - 1);
        let mut margin = Vec::with_capacity(tokens.len() - 1);
        let mut done = 0;
        for (w, win) in tokens.chunks(window).enumerate() {
            session.reset()?;
            for (c, piece) in win.chunks(chunk).enumerate() {
                let logits = session.forward(piece, true)?;
                let rows = logits.to_vec2::<f32>()?;
                for (j, row) in rows.iter().enumerate() {
                    let pos = w * window + c * chunk + j;
                    let Some(&target) = tokens.get(pos + 1) else {
                        break;
                    };
                    top1.push(argmax(row));
                    margin.push(top_margin(row));
                    nll.push(neg_log_softmax(row, target as usize));
                }
                done += piece.len();
                progress(done, tokens.len());
            }
        }
        let mean = nll.iter().map(|&x| x as f64).sum::<f64>() / nll.len() as f64;
        Ok(Perplexity {
            tokens,
            top1,
            margin,
            nll,
            ppl: mean.exp(),
        })
    }
}

fn top_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

fn neg_log_softmax(row: &[f32], target: usize) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (sum.ln() - (row[target] - max) as f64) as f32
}
