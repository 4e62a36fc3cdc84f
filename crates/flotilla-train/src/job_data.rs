//! A job's data, opened as `data.path` names it ([`crate::config::DataSource`]) or given by a
//! program ([`JobData::given`]), and checked against the model: MNIST images, a text's
//! next-token windows whose length is the model's input length, or a program's own
//! [`Samples`]. All are [`Samples`] to the rest of the run.
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
    /// Epochs of the training data already trained before this run, without a checkpoint of
    /// the run's own (a `Learner` resumed from its epoch checkpoint): a fresh run starts its
    /// batches and its count where a run resumed at that epoch's end would. 0 by default.
    pub start_epoch: u32,
}

impl JobData {
    /// Loads the data `config` names and checks that `model` takes its samples.
    pub fn load(config: &TrainConfig, model: &dyn ModelSource) -> Result<Self> {
        let (limit, test_limit) = (config.data.train_limit, config.data.test_limit);
        let (name, io) = (model.name(), model.io()?);
        let data = match config.data.source() {
            DataSource::Mnist(dir) => {
                let files = Mnist::open(&dir, Normalization::MNIST, &default_cache_dir()?)?;
                let (mut train, mut test) = (files.train, files.test);
                if let Some(limit) = limit {
                    train.truncate(limit.min(train.len()));
                }
                if let Some(limit) = test_limit {
                    test.truncate(limit.min(test.len()));
                }
                check_io(
                    name,
                    &io,
                    &[1, train.rows(), train.cols()],
                    train.num_classes().max(10),
                )?;
                JobData {
                    start_epoch: 0,
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
                if let Some(limit) = test_limit {
                    splits.validation.truncate(limit);
                }
                check_io(name, &io, &[context], BYTE_VOCAB)?;
                JobData {
                    start_epoch: 0,
                    train: Arc::new(splits.train),
                    test: Box::new(splits.validation),
                }
            }
        };
        data.check_labels(name, &io)?;
        Ok(data)
    }

    /// A program's own data: `train` to draw batches from (sharded by rank as `data.path`'s
    /// are), `test` to evaluate on. `data.train_limit` keeps the first samples of `train`,
    /// `data.test_limit` those of `test`.
    /// Every rank gives the same samples (the rendezvous compares their numbers and shape).
    pub fn given(
        config: &TrainConfig,
        model: &dyn ModelSource,
        train: Arc<dyn Samples>,
        test: Box<dyn Samples>,
    ) -> Result<Self> {
        let train = match config.data.train_limit {
            Some(limit) if limit < train.len() => {
                let first: Vec<usize> = (0..limit).collect();
                Arc::from(train.select(&first)?)
            }
            _ => train,
        };
        let test = match config.data.test_limit {
            Some(limit) if limit < test.len() => {
                let first: Vec<usize> = (0..limit).collect();
                test.select(&first)?
            }
            _ => test,
        };
        let data = JobData {
            train,
            test,
            start_epoch: 0,
        };
        data.check_given(model)?;
        Ok(data)
    }

    /// `self` starting after `epochs` epochs of its training data ([`JobData::start_epoch`]).
    pub fn starting_at_epoch(mut self, epochs: u32) -> Self {
        self.start_epoch = epochs;
        self
    }

    /// What the rendezvous compares of a program's data: its sizes and sample shape.
    pub fn fingerprint(&self) -> String {
        format!(
            "data {}x{:?}/{} test {}x{:?}/{} from epoch {}",
            self.train.len(),
            self.train.sample_shape(),
            self.train.labels_per_sample(),
            self.test.len(),
            self.test.sample_shape(),
            self.test.labels_per_sample(),
            self.start_epoch,
        )
    }

    /// A program's data is checked against the model as `data.path`'s is: the samples the
    /// model takes, its classes (token ids for a text), labels per sample; the test set
    /// like the training set.
    fn check_given(&self, model: &dyn ModelSource) -> Result<()> {
        let (name, io) = (model.name(), model.io()?);
        let (train, test) = (&self.train, &self.test);
        if train.is_empty() {
            return Err(TrainError::config(
                "data",
                "the program's training set is empty",
            ));
        }
        if test.sample_shape() != train.sample_shape()
            || test.labels_per_sample() != train.labels_per_sample()
        {
            return Err(TrainError::config(
                "data",
                format!(
                    "the program's test samples are {:?} with {} label(s) but its training \
                     samples are {:?} with {}",
                    test.sample_shape(),
                    test.labels_per_sample(),
                    train.sample_shape(),
                    train.labels_per_sample()
                ),
            ));
        }
        if train.byte_tokens() {
            text_context(name, &io)?;
        }
        // A model may give more classes than the labels use (not fewer).
        let labels = train.classes().max(test.classes());
        let classes = io.classes.map_or(labels, |out| out.max(labels));
        check_io(name, &io, &train.sample_shape(), classes)?;
        self.check_labels(name, &io)
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
    use flotilla_data::{ImageDataset, Normalization};

    use super::*;

    /// `n` blank images of `side × side` with labels `0..classes` in turn.
    fn images(n: usize, side: usize, classes: u8) -> ImageDataset {
        let labels = (0..n).map(|i| (i % usize::from(classes)) as u8).collect();
        let norm = Normalization::MNIST;
        ImageDataset::new(vec![0; n * side * side], labels, side, side, norm).expect("images")
    }

    #[test]
    fn a_programs_data_is_cut_by_its_limits_and_checked_against_the_model() {
        let mut config = TrainConfig::default();
        config.model.spec = "lenet5".into();
        config.data.train_limit = Some(30);
        let model = config.validate().expect("lenet5");
        let given = |train: ImageDataset, test: ImageDataset| {
            JobData::given(&config, &model, Arc::new(train), Box::new(test))
        };
        let data = given(images(100, 28, 10), images(20, 28, 10)).expect("MNIST-like");
        assert_eq!((data.train.len(), data.test.len()), (30, 20));
        let mut cut = config.clone();
        cut.data.test_limit = Some(8);
        let data = JobData::given(
            &cut,
            &model,
            Arc::new(images(100, 28, 10)),
            Box::new(images(20, 28, 10)),
        )
        .expect("a test limit");
        assert_eq!((data.train.len(), data.test.len()), (30, 8));
        // Fewer classes in the labels than the model gives: fine; more: refused.
        given(images(100, 28, 7), images(20, 28, 7)).expect("7 of 10 classes");
        let e = given(images(100, 28, 12), images(20, 28, 10))
            .err()
            .expect("12 classes");
        assert!(e.to_string().contains("12 classes"), "{e}");
        let e = given(images(100, 20, 10), images(20, 20, 10))
            .err()
            .expect("20x20");
        assert!(e.to_string().contains("[1, 20, 20]"), "{e}");
        let e = given(images(100, 28, 10), images(20, 14, 10))
            .err()
            .expect("test 14x14");
        assert!(e.to_string().contains("test samples"), "{e}");
        let e = given(images(0, 28, 10), images(20, 28, 10))
            .err()
            .expect("empty");
        assert!(e.to_string().contains("empty"), "{e}");
    }

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
