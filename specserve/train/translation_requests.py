"""Translation requests for the trainer's templated data (request_templates.py): English sentences into
other languages, and sentences of those languages into English.

A head learns to draft what the target writes; asked to translate, the
target writes French or Swedish, token sequences an English-only training
set never shows. Sentences are built from slots (names, places, times,
numbers) so that thousands differ; the sentences in other languages are
written for this module. None is taken from the acceptance suite, whose
translation category is written apart (tests/test_acceptance_suite.py
measures the 8-gram overlap).
"""
from __future__ import annotations

import random
from collections.abc import Sequence

NAMES = ("Anna", "Lucas", "Sofia", "Jonas", "Marta", "Pedro", "Emma", "Karl", "Julia", "Marco", "Lea", "Nils")
CITIES = ("Lyon", "Seville", "Hamburg", "Turin", "Porto", "Utrecht", "Uppsala", "Geneva", "Bilbao", "Graz")
RELATIVES = ("my sister", "our neighbour", "my uncle", "their teacher", "his cousin", "her grandfather",
             "my best friend", "our landlord", "the new manager", "my colleague")
PLACES = ("the station", "the bakery", "the town hall", "the swimming pool", "the post office", "the harbour",
          "the university", "the museum shop", "the bus stop", "the market square")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
THINGS = ("a bicycle", "a small flat", "a second-hand car", "a new laptop", "a piano", "a garden table",
          "a winter coat", "a pair of boots", "a tent", "a fishing rod")
ACTIVITIES = ("painting", "cooking Thai food", "playing chess", "running", "learning Japanese", "baking bread",
              "sailing", "knitting", "climbing", "taking photographs")

ENGLISH_SENTENCES = (
    "{name} is moving to {city} in the spring because {name2} found a job there.",
    "{relative} asked me to buy {thing} before the shops close on {day}.",
    "The bus to {place} leaves every {n} minutes, but it is always late when it rains.",
    "We waited for {name} outside {place} for almost an hour, and then it started to snow.",
    "If you walk past {place}, turn left and you will see a green door with a brass bell.",
    "{name} has been {activity} every evening since {relative} recommended it.",
    "Last {day} I lost my keys somewhere between {place} and the car park.",
    "The price of {thing} went up by {n} euros, so we decided to wait until the sales.",
    "{relative} says that {city} is the most beautiful city to visit in October.",
    "I am sorry, but I cannot come to dinner on {day} because I have to work late.",
    "Our train to {city} was cancelled, so we took a taxi and shared the cost.",
    "{name} and {name2} met at {place} on a rainy afternoon {n} years ago.",
    "Could you lend me {thing} for the weekend? I will give it back on {day}.",
    "The children spent the whole afternoon {activity} in the garden.",
    "{relative} never drinks coffee after four o'clock because it makes sleeping difficult.",
    "There are {n} rooms in the hotel, and every one of them has a balcony facing the sea.",
    "When {name} arrived in {city}, the whole street was decorated for the festival.",
    "Please call {place} and ask whether they are open on public holidays.",
    "{name2} wants to sell {thing} because there is no room for it in the new flat.",
    "It took us {n} hours to drive to {city} because of the roadworks on the motorway.",
)
# Each sentence names its slots in English form; {n} is a number written in digits, as the languages share.
FOREIGN_SENTENCES: dict[str, tuple[str, ...]] = {
    "French": (
        "{name} habite à {city} depuis {n} ans et travaille dans une petite librairie.",
        "Nous avons rendez-vous devant la gare à {n} heures, ne sois pas en retard.",
        "Mon frère a acheté un vélo d'occasion pour aller au travail tous les matins.",
        "Il pleut depuis ce matin, alors nous restons à la maison avec un bon livre.",
    ),
    "Spanish": (
        "{name} vive en {city} desde hace {n} años y trabaja en un restaurante del centro.",
        "Si llegas antes de las {n}, podemos tomar un café en la plaza antes de la reunión.",
        "Mi vecina tiene tres gatos y todos duermen en el balcón cuando hace sol.",
        "Hemos alquilado una casa cerca de la playa para las vacaciones de verano.",
    ),
    "German": (
        "{name} wohnt seit {n} Jahren in {city} und arbeitet in einer kleinen Bäckerei.",
        "Kannst du mich morgen um {n} Uhr vom Bahnhof abholen? Mein Zug kommt dann an.",
        "Am Wochenende wollen wir mit den Kindern in den Bergen wandern gehen.",
        "Das Museum ist heute geschlossen, aber der Park daneben ist den ganzen Tag offen.",
    ),
    "Italian": (
        "{name} vive a {city} da {n} anni e lavora in un negozio di scarpe.",
        "Domani mattina andiamo al mercato a comprare la frutta e il pane fresco.",
        "Il treno per {city} parte alle {n}, quindi dobbiamo uscire di casa presto.",
        "Mia sorella ha imparato a suonare il violino quando era molto piccola.",
    ),
    "Portuguese": (
        "{name} mora em {city} há {n} anos e trabalha numa farmácia perto do rio.",
        "Vamos jantar fora hoje à noite, porque ninguém quer cozinhar depois do trabalho.",
        "O meu avô conta sempre histórias sobre a aldeia onde cresceu.",
        "A loja abre às {n} horas, mas é melhor chegar cedo porque há sempre fila.",
    ),
    "Dutch": (
        "{name} woont al {n} jaar in {city} en werkt bij een kleine boekhandel.",
        "Morgen gaan we met de trein naar het strand als het niet regent.",
        "Mijn buurman heeft een nieuwe auto gekocht, maar hij fietst nog steeds naar zijn werk.",
        "De winkel sluit om {n} uur, dus we moeten opschieten.",
    ),
    "Swedish": (
        "{name} har bott i {city} i {n} år och arbetar på ett litet kafé.",
        "Vi ska äta middag hos mina föräldrar på söndag, vill du följa med?",
        "Bussen till stan går varje halvtimme, men på kvällen går den mer sällan.",
        "Min syster har lärt sig att baka bröd och gör det varje helg nu.",
    ),
}
LANGUAGES = (*FOREIGN_SENTENCES, "Polish")
INTO_ASKS = (
    "Translate to {lang}: {text}", "Can you put this into {lang}?\n\n{text}",
    "{text}\n\nTranslate the above into {lang}.", "Give me the {lang} version of this text: {text}",
    "I need this in {lang}, please: \"{text}\"", "Translate this message into {lang} for a friend: {text}",
)
FROM_ASKS = (
    "Translate to English: {text}", "What is the English for this {lang} text? {text}",
    "{text}\n\nPlease render this {lang} sentence in English.",
    "My friend wrote this in {lang}. What does it say in English? \"{text}\"",
    "Translate from {lang} into English, word for word and then naturally: {text}",
)


def _fill(rng: random.Random, template: str) -> str:
    name, name2 = rng.sample(NAMES, 2)
    return template.format(name=name, name2=name2, city=rng.choice(CITIES), relative=rng.choice(RELATIVES),
                           place=rng.choice(PLACES), day=rng.choice(DAYS), thing=rng.choice(THINGS),
                           activity=rng.choice(ACTIVITIES), n=rng.randint(2, 30))


def _capitalised(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def translation_request(rng: random.Random, topics: Sequence[str] = ()) -> str:
    """One request: mostly English (one to three sentences) into another language, else the other way."""
    if rng.random() < 0.7:
        sentences = [_capitalised(_fill(rng, t)) for t in rng.sample(ENGLISH_SENTENCES, rng.choice((1, 1, 2, 3)))]
        return rng.choice(INTO_ASKS).format(lang=rng.choice(LANGUAGES), text=" ".join(sentences))
    lang = rng.choice(tuple(FOREIGN_SENTENCES))
    return rng.choice(FROM_ASKS).format(lang=lang, text=_fill(rng, rng.choice(FOREIGN_SENTENCES[lang])))
