//! A job's data, opened as `data.path` names it ([`crate::config::DataSource`]) and checked
//! against the model: MNIST images, or a text's next-token windows whose length is the
//! model's input length. Both are [`Samples`] to the rest of the run.
//!
//! MNIST images stay in their files ([`flotilla_data::ImageFile`]: a gzipped file through
//! its raw copy in [`default_cache_dir`]); a rank reads the samples it uses: each epoch's
//! shard ([`crate::batches`]), the test samples it evaluates. A text is held whole (the
//! vendored one is 1 MB; its windows overlap, so a shard of them is no smaller).

use std::sync::Arc;

use flotilla_data::{BYTE_VOCAB, Mnist, Normalization, Samples, TextSplits, default_cache_dir};

use crate::config::{DataSource, TrainConfig};
use crate::error::{Result, TrainError};
use crate::strategy::context::{ModelIo, ModelSource};

/// The training set and the set evaluation runs on (MNIST's test set, a text's validation
/// windows).
pub struct JobData {
    /// The training samples.
    pub train: Arc<dyn Samples>,
    /// The evaluation samples.
    pub test: Box<dyn Samples>,
}

impl JobData {
    /// Loads the data `config` names and checks that `model` takes its samples.
    pub fn load(config: &TrainConfig, model: &dyn ModelSource) -> Result<Self> {
        let limit = config.data.train_limit;
        let (name, io) = (model.name(), model.io()?);
        let data = match config.data.source() {
            DataSource::Mnist(dir) => {
                let files = Mnist::open(&dir, Normalization::MNIST, &default_cache_dir()?)?;
                let (mut train, test) = (files.train, files.test);
                if let Some(limit) = limit {
                    train.truncate(limit.min(train.len()));
                }
                check_io(
                    name,
                    &io,
                    &[1, train.rows(), train.cols()],
                    train.num_classes().max(10),
                )?;
                JobData {
                    train: Arc::new(train),
                    test: Box::new(test),
                }
            }
            DataSource::Text(file) => {
                let context = text_context(name, &io)?;
                let mut splits = TextSplits::load(&file, context)?;
                if let Some(limit) = limit {
                    splits.train.truncate(limit);
                }
                check_io(name, &io, &[context], BYTE_VOCAB)?;
                JobData {
                    train: Arc::new(splits.train),
                    test: Box::new(splits.validation),
                }
            }
        };
        data.check_labels(name, &io)?;
        Ok(data)
    }

    /// The model gives as many classes per sample as the data has labels (one, or one per
    /// position).
    fn check_labels(&self, name: &str, io: &ModelIo) -> Result<()> {
        let (model, data) = (io.labels_per_sample, self.train.labels_per_sample());
        if model != data {
            return Err(TrainError::config(
                "data",
                format!(
                    "the model `{name}` gives {model} class(es) per sample but the data set has \
                     {data} label(s) per sample of shape {:?}",
                    self.train.sample_shape()
                ),
            ));
        }
        Ok(())
    }
}

/// The model takes the data's `sample`s and, when it says how many, gives `classes` logits
/// (per position, for a sequence model).
fn check_io(name: &str, io: &ModelIo, sample: &[usize], classes: usize) -> Result<()> {
    let (own, given) = (
        io.input.iter().product::<usize>(),
        sample.iter().product::<usize>(),
    );
    if own != given {
        return Err(TrainError::config(
            "data",
            format!(
                "the model `{name}` takes input {:?} but the data set gives samples of {sample:?}",
                io.input
            ),
        ));
    }
    match io.classes {
        Some(out) if out != classes => Err(TrainError::config(
            "data",
            format!(
                "the model `{name}` gives {out} outputs but the data set has {classes} classes"
            ),
        )),
        _ => Ok(()),
    }
}

/// The window length of a text data set: the model's input length, when it takes token ids.
fn text_context(name: &str, io: &ModelIo) -> Result<usize> {
    match (io.input.as_slice(), io.vocab) {
        (&[t], Some(vocab)) if vocab >= BYTE_VOCAB => Ok(t),
        (&[_], Some(vocab)) => Err(TrainError::config(
            "data",
            format!(
                "a text data set has byte tokens (a vocabulary of {BYTE_VOCAB}) but the model \
                 `{name}` embeds only {vocab} tokens"
            ),
        )),
        (shape, _) => Err(TrainError::config(
            "data",
            format!(
                "a text data set gives windows of token ids, input [T], but the model `{name}` \
                 takes input {shape:?} and does not take token ids"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(input: &[usize], classes: Option<usize>) -> ModelIo {
        ModelIo {
            input: input.to_vec(),
            vocab: None,
            classes,
            labels_per_sample: 1,
        }
    }

    #[test]
    fn a_model_that_does_not_take_the_datas_samples_or_classes_is_refused_naming_both() {
        check_io("mlp", &io(&[784], Some(10)), &[1, 28, 28], 10).expect("same numbers");
        check_io("net", &io(&[1, 28, 28], None), &[1, 28, 28], 10).expect("classes unknown");
        let e = check_io("mlp", &io(&[784], Some(10)), &[1, 28, 28], 7)
            .expect_err("classes")
            .to_string();
        assert!(
            e.contains("`mlp` gives 10 outputs") && e.contains("7 classes"),
            "{e}"
        );
        let e = check_io("mlp", &io(&[100], Some(10)), &[1, 28, 28], 10)
            .expect_err("input")
            .to_string();
        assert!(
            e.contains("takes input [100]") && e.contains("[1, 28, 28]"),
            "{e}"
        );
    }
}
